"""The quantization arithmetic and its ONNX definition: descriptors, granularity, storage formats, the
quantize ops (``tensor_quant``, ``affine``) and the Q/DQ nodes their ``symbolic`` builds."""
