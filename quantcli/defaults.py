"""The defaults a user meets: every value an option of ``quantcli`` takes when it is left out, in one place.

The library's functions and request objects take their defaults from here and the command line declares its
options with them, so ``--help`` shows what the library does. Nothing is imported: the command line reads this
module before any heavy one loads.
"""

CONFIG = "int8"  # calibrate --config: the preset
METHOD = "max"  # calibrate --method: the activation amax method
PERCENTILE = 99.99  # --percentile, in percent, for the percentile method
NUM_BINS = 2048  # --num-bins: histogram bins for entropy, mse and percentile (also analyze's statistics)
BATCH_SIZE = 32  # --batch-size: whole arrays are re-batched into batches of this many samples
MAX_LENGTH = 128  # --max-length: tokens per text example
DEVICE = "auto"  # --device: cuda where there is a GPU, else cpu
DTYPE = "model"  # calibrate --dtype: the observing pass runs in the model's own floating dtype
POOLING = "none"  # --pooling: a Hugging Face base model's output as is
WEIGHT_METHOD = "rtn"  # --weight-method: int4 weight rounding
PLACEMENT = "auto"  # --placement: layers onnxruntime would not run faster quantized stay float
KV_CACHE = "float"  # --kv-cache: a causal LM's decode-graph KV cache (int8: calibrated scales per channel)
DIST_TIMEOUT = 600.0  # --dist-timeout: seconds a torchrun rank waits for the others
SENSITIVITY_SAMPLES = 64  # analyze --num-samples: samples the sensitivity passes use
MAX_DEPLOY_RATIO = 1.0  # verify --max-deploy-ratio: the deployed session's bound (docs/verify-criteria.md)
MAX_RMS_RATIO = 2.0  # verify --max-rms-ratio (docs/verify-criteria.md: correct exports measured up to 0.87)
