"""The public Python names (the README's Python API) resolve to what they promise, whatever was imported
first."""

import importlib
import inspect


def test_contract_names():
    import quantcli.calibration.calibrate  # noqa: F401  (import the submodules first: names must not be shadowed)
    import quantcli.verify  # noqa: F401

    quantcli = importlib.import_module("quantcli")
    from quantcli import (  # noqa: F401
        QuantDescriptor,
        fake_affine_tensor_quant,
        fake_tensor_quant,
        scaled_e4m3,
        tensor_quant,
    )
    from quantcli.quant.affine import (  # noqa: F401
        FakeQuantizeConfig,
        MappingType,
        ZeroPointDomain,
        choose_qparams_affine,
        dequantize,
        dequantize_affine,
        quantize,
        quantize_affine,
        quantize_dequantize,
    )
    from quantcli.quant.tensor_quant import (  # noqa: F401
        FakeAffineTensorQuantFunction,
        FakeTensorQuantFunction,
        LegacyFakeTensorQuantFunction,
        ScaledE4M3Function,
        ScaledQuantDescriptor,
        TensorQuantFunction,
    )

    assert QuantDescriptor is ScaledQuantDescriptor
    assert fake_tensor_quant == FakeTensorQuantFunction.apply
    assert callable(tensor_quant)
    assert inspect.isfunction(quantcli.calibrate) and list(inspect.signature(quantcli.calibrate).parameters)[
        :3
    ] == ["model", "batches", "method"]
    assert inspect.isfunction(quantcli.quantize_model) and inspect.isfunction(quantcli.verify_onnx)
    assert inspect.isfunction(quantcli.load_calibrated)
    from calibrators import HistogramCalibrator, MaxCalibrator  # noqa: F401
    from exporters import export_onnx

    assert list(inspect.signature(export_onnx).parameters)[:5] == [
        "model",
        "example_inputs",
        "path",
        "opset",
        "exporter",
    ]
    assert list(inspect.signature(quantcli.verify_onnx).parameters)[:3] == [
        "onnx_path",
        "calibrated",
        "batches",
    ]


def test_cli_help_lists_only_built_commands():
    from tests.helpers import cli

    r = cli("--help")
    assert r.exit_code == 0
    for name in ("calibrate", "export", "verify", "inspect"):
        assert name in r.output
    assert cli("--version").output.startswith("quantcli ")
