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


def test_library_entry_points_refuse_batches_of_the_wrong_kind_with_the_fix(tmp_path):
    """A dict for calibrate's list of batches, a bare tensor, an example without forward's argument names:
    each ended deep in torch or Python ('str' object has no attribute 'values', "Boolean value of Tensor ...
    is ambiguous", forward() got an unexpected keyword argument) instead of a DataError saying what to
    pass."""
    import pytest
    import torch
    from torch import nn

    from exporters import export_onnx
    from quantcli import calibrate, quantize_model
    from quantcli.errors import DataError
    from quantcli.verify.driver import _verification_batches

    model = quantize_model(nn.Sequential(nn.Linear(4, 3)), "int8")
    batch = {"input": torch.randn(8, 4)}
    for wrong, words in (
        (batch, r"a list of batches.*wrap it in a list, \[batch\]\); got dict"),
        (torch.randn(8, 4), "a list of batches.*got Tensor"),
        ([torch.randn(8, 4)], r"batches\[0\] is one batch.*got Tensor"),
        ([{"input": [1.0, 2.0]}], r"batches\[0\]: input 'input' is a list, not a torch tensor"),
    ):
        with pytest.raises(DataError, match=words):
            calibrate(model, wrong)
    calibrate(model, [batch])
    with pytest.raises(DataError, match="example_inputs is one batch.*got Tensor"):
        export_onnx(model, torch.randn(2, 4), tmp_path / "m.onnx")
    with pytest.raises(DataError, match=r"input 'y' is not an argument of forward\(input\)"):
        export_onnx(model, {"y": torch.randn(2, 4)}, tmp_path / "m.onnx")
    assert not (tmp_path / "m.onnx").exists()
    with pytest.raises(DataError, match="verify's batches is a list of batches"):
        _verification_batches(None, batch)
    from quantcli import save_calibrated
    from quantcli.errors import ConfigError

    with pytest.raises(ConfigError, match=r"the ModelSpec the model was loaded.*parse_spec\('m.py:mlp'\)"):
        save_calibrated(tmp_path / "m.calib.pt", model, "m.py:mlp", batch)
    assert not (tmp_path / "m.calib.pt").exists()
