"""``calibrate(dtype=...)`` / ``calibrate --dtype``: the observing pass in half precision, as LLMs run on a
GPU. The activations are the model's own in that dtype (so every max is a value of it), the amax are those of
a float32 run within that rounding, and the model, its weights and their amax are exactly as a float32 run
leaves them."""

from __future__ import annotations

import pytest
import torch

from quantcli import quantize_model
from quantcli.calibration.calibrate import calibrate
from quantcli.errors import CalibrationError
from quantcli.nn import quantizers
from tests.helpers import assert_clean_error, cli, cli_subprocess


def _calibrated(name: str, dtype, method: str = "max"):
    from quantcli.inputs.loading import load_model
    from sample_models import digits_cnn, text_encoder

    batches = (digits_cnn if name == "digits_cnn" else text_encoder).calibration_batches()[:4]
    model = quantize_model(load_model(name)[0])
    before = {k: v.clone() for k, v in model.state_dict().items()}
    calibrate(model, batches, method, device="cpu", dtype=dtype)
    return model, before


def _activation_amax(model) -> dict[str, torch.Tensor]:
    return {
        n: q.amax
        for n, q in quantizers(model).items()
        if q.amax is not None and not n.endswith("weight_quantizer")
    }


@pytest.mark.parametrize("name", ["digits_cnn", "text_encoder"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_amax_within_its_rounding_of_float32(name, dtype):
    full, _ = _calibrated(name, None)
    half, before = _calibrated(name, str(dtype).removeprefix("torch."))
    want, got = _activation_amax(full), _activation_amax(half)
    assert want.keys() == got.keys() and len(want) >= 4
    eps = torch.finfo(dtype).eps
    for n, a in got.items():
        # a max of values computed in ``dtype`` is one of them: representable there (a float32 run's mostly is
        # not), and within two of its steps of the float32 run's max
        assert torch.equal(a.to(dtype).float(), a), n
        assert torch.allclose(a, want[n], rtol=2 * eps, atol=0), (n, float(a), float(want[n]))
    assert any(not torch.equal(want[n].to(dtype).float(), want[n]) for n in want)
    # the weights, every buffer and each weight amax are exactly what they were / what float32 gives
    after = half.state_dict()
    for k, v in before.items():
        if not k.endswith((".amax", ".amin")):
            assert after[k].dtype == v.dtype and torch.equal(after[k], v), k
    for n, q in quantizers(half).items():
        if n.endswith("weight_quantizer") and q.amax is not None:
            assert torch.equal(q.amax, quantizers(full)[n].amax), n


def test_unknown_dtype_is_refused():
    with pytest.raises(CalibrationError, match="unknown dtype 'int8'; choose one of model, float32"):
        _calibrated("digits_cnn", "int8")


def test_cli_dtype_writes_the_float32_checkpoint(tmp_path):
    out, ref = tmp_path / "half.calib.pt", tmp_path / "full.calib.pt"
    args = ("calibrate", "digits_cnn", "--num-samples", "256", "--placement", "all")
    assert cli(*args, "--dtype", "bfloat16", "--out", out).exit_code == 0
    assert cli(*args, "--out", ref).exit_code == 0
    half = torch.load(out, weights_only=True)["state_dict"]
    full = torch.load(ref, weights_only=True)["state_dict"]
    assert half.keys() == full.keys()
    for k, v in full.items():
        assert half[k].dtype == v.dtype, k
        if k.endswith("input_quantizer.amax"):
            assert torch.equal(half[k].bfloat16().float(), half[k]), k
            assert torch.allclose(half[k], v, rtol=2 * torch.finfo(torch.bfloat16).eps), k
        else:
            assert torch.equal(half[k], v), k
    bad = cli_subprocess(
        "calibrate", "digits_cnn", "--dtype", "int8", "--out", tmp_path / "x.pt", cwd=tmp_path
    )
    assert_clean_error(bad, "--dtype", "'int8' is not one of")


def test_a_float16_overflow_is_named_as_one():
    """Activations past float16's 65504 under --dtype float16 were reported as "non-finite values ... check
    the input data and the model's numerics", though the data and the float32 model are finite."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2)).eval()
    with torch.no_grad():
        model[0].weight.fill_(1e4)
    m = quantize_model(model, "int8")
    batches = [{"input": torch.full((8, 4), 10.0)}]
    overflow = "1.input_quantizer.*in float16 here, whose largest value is 65504"
    with pytest.raises(CalibrationError, match=overflow):
        calibrate(m, batches, "max", device="cpu", dtype="float16")
    calibrate(m, batches, "max", device="cpu", dtype="float32")  # finite: 4e5 fits float32
