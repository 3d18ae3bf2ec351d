"""--weight-method rtn|gptq|awq (quantcli.calibration.weight_rounding, quantcli.calibration.awq) on
weight-only layers: AWQ's search against a numpy computation of the error it minimises, and the sample decoder
end to end through the CLI."""

import json

import numpy as np
import pytest
import torch

from quantcli import load_calibrated
from quantcli.calibration.awq import search_scale
from quantcli.nn.modes import quantizer_modes
from sample_models import tiny_lm
from tests.helpers import assert_clean_error, cli


def _rtn_error(w: np.ndarray, x: np.ndarray, block: int) -> float:
    """sum over the samples of |x (W - Q(W)).T|^2 with Q: blocks of ``block`` input channels, amax = max
    |w|."""
    out, k = w.shape
    amax = np.abs(w.reshape(out, k // block, block)).max(-1)
    scale = np.repeat(amax.astype(np.float32) / np.float32(7), block, axis=1)
    q = np.clip(np.round(w / scale), -8, 7) * scale
    return float(np.sum((x.astype(np.float64) @ (w - q).T.astype(np.float64)) ** 2))


def test_awq_search_lowers_the_layer_output_error_it_optimises(rng):
    k, block = 128, 32
    loud = np.where(np.arange(k) % 9 == 0, 20.0, 1.0)  # a few input channels carry large activations
    x = (rng.standard_normal((1024, k)) * loud).astype(np.float32)
    weights = [rng.standard_normal((48, k)).astype(np.float32) * 0.05 for _ in range(2)]  # two readers of x
    h = torch.from_numpy(2.0 * x.astype(np.float64).T @ x.astype(np.float64))
    mean_abs = torch.from_numpy(np.abs(x).mean(0).astype(np.float64))
    s, alpha, errors = search_scale([torch.from_numpy(w) for w in weights], mean_abs, h, 4, block)
    rtn = sum(_rtn_error(w, x, block) for w in weights)
    # alpha = 0 is round-to-nearest: the objective equals the numpy error (times 2: H = 2 X.T X)
    assert errors[0.0] == pytest.approx(2 * rtn, rel=1e-9)
    assert alpha > 0 and errors[alpha] == min(errors.values()) and errors[alpha] < 0.8 * errors[0.0]
    # the returned scale reproduces the chosen error, computed here from scratch
    sc = s.numpy().astype(np.float32)
    err = 0.0
    for w in weights:
        ws = w * sc
        amax = np.abs(ws.reshape(48, k // block, block)).max(-1).astype(np.float32)
        scale = np.repeat(amax / np.float32(7), block, axis=1)
        q = (np.clip(np.round(ws / scale), -8, 7) * scale) / sc
        err += float(np.sum((x.astype(np.float64) @ (w - q).T.astype(np.float64)) ** 2))
    assert errors[alpha] == pytest.approx(2 * err, rel=1e-6)


@pytest.fixture(scope="module")
def lm_checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("lm")
    out = {}
    for method in ("rtn", "gptq", "awq"):
        path = root / f"{method}.calib.pt"
        r = cli(
            "calibrate",
            "tiny_lm",
            "--config",
            "int4-weight-only",
            "--weight-method",
            method,
            "--out",
            path,
            "--json",
        )
        assert r.exit_code == 0, r.output
        out[method] = (path, json.loads(r.stdout))
    return out


def _perplexity(model) -> float:
    with torch.no_grad():
        return tiny_lm.perplexity(
            lambda ids: model(input_ids=torch.from_numpy(ids)).numpy(), tiny_lm.evaluation_batches()
        )


def test_weight_methods_are_stored_and_gptq_beats_rounding(lm_checkpoints):
    infos = {m: info["weight_rounding"] for m, (_, info) in lm_checkpoints.items()}
    assert infos["rtn"] == {"method": "rtn"}
    assert (
        infos["gptq"]["method"] == "gptq"
        and infos["gptq"]["layers"] == 13
        and infos["gptq"]["rows"] == 256 * 64
    )
    assert infos["awq"]["method"] == "awq" and infos["awq"]["layers"] == 13
    for m, (path, _) in lm_checkpoints.items():  # stored in the checkpoint itself
        assert load_calibrated(path).data["calibration"]["weight_rounding"]["method"] == m
    ppl = {m: _perplexity(load_calibrated(path).model) for m, (path, _) in lm_checkpoints.items()}
    fp32 = _perplexity(tiny_lm.build())
    assert ppl["gptq"] < ppl["rtn"] and ppl["gptq"] <= 1.05 * fp32


def test_awq_folds_keep_the_float_model(lm_checkpoints):
    """AWQ moved scales into the weights and 1/s into LayerNorms, Linears or Muls: with every quantizer off
    the model computes what the trained model computes, to float rounding."""
    ck = load_calibrated(lm_checkpoints["awq"][0])
    ids = tiny_lm.evaluation_batches()[0]["input_ids"]
    with torch.no_grad(), quantizer_modes(ck.model, "disabled"):
        got = ck.model(input_ids=ids)
    want = tiny_lm.build()(ids).detach()
    assert (got - want).abs().max() <= 1e-4 * want.abs().max()
    # 9 tensors read by 13 layers
    assert sum(ck.data["calibration"]["weight_rounding"]["folds"].values()) == 9


def test_gptq_checkpoint_keeps_the_float_model_before_rounding(lm_checkpoints):
    """GPTQ moves float weights as it rounds (part of quantization): the transformed float model verify checks
    against the model as loaded is the one before that move, while the stored weights are GPTQ's."""
    ck = load_calibrated(lm_checkpoints["gptq"][0])
    ids = tiny_lm.evaluation_batches()[0]["input_ids"]
    want = tiny_lm.build()(ids).detach()
    with torch.no_grad():
        got = ck.transformed_float_model()(input_ids=ids)
        with quantizer_modes(ck.model, "disabled"):
            moved = ck.model(input_ids=ids)
    assert (got - want).abs().max() <= 1e-4 * want.abs().max()
    assert (moved - want).abs().max() > 1e-2 * want.abs().max()  # GPTQ's stored weights do differ


def test_gptq_checkpoint_exports_exactly(lm_checkpoints, tmp_path):
    path = lm_checkpoints["gptq"][0]
    onnx_path = tmp_path / "lm.onnx"
    r = cli("export", path, "--onnx", onnx_path, "--json")
    assert r.exit_code == 0, r.output
    assert json.loads(r.stdout)["unfused_layers"] == 0
    r = cli("verify", onnx_path, "--reference", path, "--json")
    assert r.exit_code == 0, r.output
    assert json.loads(r.stdout)["structure"]["passed"]


def test_bad_weight_method_and_no_weight_only_layers(tmp_path):
    assert_clean_error(
        cli("calibrate", "digits_cnn", "--weight-method", "sgd", "--out", tmp_path / "a.pt"),
        "--weight-method",
        "sgd",
    )
    assert_clean_error(
        cli("calibrate", "digits_cnn", "--weight-method", "gptq", "--out", tmp_path / "b.pt"), "weight-only"
    )
    assert not (tmp_path / "a.pt").exists() and not (tmp_path / "b.pt").exists()


@pytest.mark.cuda
@pytest.mark.parametrize("method", ["gptq", "awq"])
def test_weight_rounding_runs_on_the_models_cuda_device(method):
    """The statistics and the rounding stay on the GPU the model is on, and give the CPU's result to float32
    rounding of the Hessian products (at least 99% of the codes equal). Codes, not values: the GPU's AWQ
    scales and amax differ from the CPU's in the last bit (float64 pow rounded to float32; measured on an
    H100), which moves every dequantized value of a block by ~1e-7 relative while a different code moves it by
    a whole step."""
    from quantcli import calibrate, quantize_model
    from quantcli.calibration.weight_rounding import awq, gptq

    def run(device):
        model = quantize_model(tiny_lm.build(), {"preset": "int4-weight-only"})
        batches = tiny_lm.calibration_batches()[:2]
        if method == "awq":
            awq(model, batches, device=device)
        calibrate(model, batches, device=device)
        if method == "gptq":
            report = gptq(model, batches)
            assert report.layers and all(
                p.device.type == torch.device(device).type for p in model.parameters()
            )
        return model.cpu()

    cpu, gpu = run("cpu"), run("cuda")
    for name, m in cpu.named_modules():
        if hasattr(m, "weight_quantizer") and m.weight_quantizer.enabled:
            a = m.weight_quantizer(m.weight.detach())
            b = dict(gpu.named_modules())[name]
            b = b.weight_quantizer(b.weight.detach())
            assert torch.isclose(a, b, rtol=1e-5, atol=0).float().mean() >= 0.99, name


def test_sequential_gptq_takes_each_hessian_on_the_rounded_layers_outputs():
    """Layer 2's Hessian comes from layer 1's output with layer 1 already rounded (GPTQ's order); the one-pass
    variant takes it from the float layer 1."""
    from quantcli import calibrate, quantize_model
    from quantcli.calibration.gptq import gptq_weights
    from quantcli.calibration.weight_rounding import gptq

    torch.manual_seed(0)
    batches = [{"input": torch.randn(32, 64) * torch.linspace(0.2, 3.0, 64)} for _ in range(3)]

    def fresh():
        m = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Linear(64, 32))
        torch.manual_seed(1)
        for p in m.parameters():
            torch.nn.init.normal_(p, std=0.1)
        m = quantize_model(m, {"preset": "int4-weight-only", "block_size": 32})
        calibrate(m, batches, device="cpu")
        return m

    for sequential in (True, False):
        model, ref = fresh(), fresh()
        gptq(model, batches, sequential=sequential)
        # by hand: layer 1 from the float inputs, then layer 2 from layer 1's (rounded or float) outputs
        x = torch.cat([b["input"] for b in batches]).double()
        h1 = 2 * x.T @ x
        q1 = ref[0].weight_quantizer
        w1 = gptq_weights(ref[0].weight.detach(), h1, q1.amax, 4)
        assert torch.equal(model[0].weight.detach(), w1)
        with torch.no_grad():
            original = ref[0].weight.detach().clone()
            ref[0].weight.copy_(w1)
            w_used = q1(ref[0].weight) if sequential else original  # rounded layer 1, or the float one
            x2 = torch.nn.functional.linear(x.float(), w_used, ref[0].bias).double()
        w2 = gptq_weights(ref[1].weight.detach(), 2 * x2.T @ x2, ref[1].weight_quantizer.amax, 4)
        assert torch.allclose(model[1].weight.detach(), w2, atol=1e-6), sequential


@pytest.mark.parametrize("method", ["gptq", "awq"])
def test_layers_weight_rounding_leaves_to_nearest_are_named(tmp_path, method):
    """nn.MultiheadAttention's projections, quantized where they run (out_proj is never called as a module),
    were left to round-to-nearest under --weight-method gptq with ``skipped: {}`` and no summary row."""
    from tests import user_models

    calib, _ = user_models.write_data("multihead_attention", tmp_path)
    ck, model = tmp_path / "m.calib.pt", user_models.spec("multihead_attention")
    args = ("--data", calib, "--config", "int4-weight-only", "--weight-method", method)
    r = cli("calibrate", model, *args, "--out", ck, "--json")
    assert r.exit_code == 0, r.output
    rounding = json.loads(r.stdout)["weight_rounding"]
    assert rounding["layers"] == 2  # embed, head
    assert sorted(rounding["skipped"]) == ["attn", "attn.out_proj"]
    assert all("rounded to nearest" in why for why in rounding["skipped"].values())
    r = cli("calibrate", model, *args, "--out", ck)
    assert r.exit_code == 0 and "weight rounding" in r.stdout and "attn.out_proj" in r.stdout, r.output
