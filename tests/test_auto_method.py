"""``--method auto``: per activation quantizer, the candidate amax with the smallest layer-output MSE.

The criterion is recomputed here independently: every layer's calibration inputs captured with a forward hook
on the float model, quantized with a hand-written int8 fake quantization (round half to even, scale ``amax /
127``), through ``F.linear`` with the per-channel int8 weight and the int32 bias the onnxruntime target
simulates (units of x_scale * w_scale), against the float ``F.linear``. With 64 samples every input row fits
in the bounded sample, so this is the very criterion auto minimises.
"""

import json

import pytest
import torch
import torch.nn.functional as F

from calibrators.auto import CANDIDATES, choose
from tests.helpers import cli


def _fq(x, amax, bound=127):
    s = amax.to(torch.float32) / bound
    return torch.clamp(torch.round(x / s), -bound - 1, bound) * s


def _int32_bias(bias, x_amax, w_amax):
    """The onnxruntime target's bias: int32 codes in units of x_scale * w_scale (what QGemm adds),
    dequantized."""
    unit = (torch.tensor(x_amax, dtype=torch.float32) / 127) * (w_amax.reshape(-1).to(torch.float32) / 127)
    return torch.round(bias / unit) * unit


#: the symmetric candidates (max, percentile, mse, entropy amax) these tests recompute; asymmetric quantizers
#: (the onnxruntime target's default) choose among ranges: test_asymmetric_quantizers_choose_among_ranges
#: on 8-bit weights (a CPU with VNNI): the criterion is recomputed with int8 weights; the deployment CPU's
#: grid is tests/test_saturation.py's
#: the projections of one attention layer that read one tensor
QKV = ("query", "key", "value")

SYMMETRIC = {"preset": "int8", "asymmetric_activations": False, "cpu": "x86-vnni"}


@pytest.fixture(scope="module")
def auto_run():
    from quantcli.calibration.calibrate import calibrate
    from quantcli.inputs.data import cap_samples
    from quantcli.nn import quantize_model
    from quantcli.nn.tensor_quantizer import quantizers
    from sample_models import text_encoder

    batches = cap_samples(text_encoder.calibration_batches(), 64)
    model = quantize_model(text_encoder.build(), SYMMETRIC)
    summary = calibrate(model, batches, "auto", device="cpu")
    ref = {}
    for method in ("max", "percentile"):
        m = quantize_model(text_encoder.build(), SYMMETRIC)
        calibrate(m, batches, method, device="cpu")
        ref[method] = {n: q.amax.clone() for n, q in quantizers(m).items()}
    return model, summary, batches, ref


def test_every_layer_input_gets_a_choice_with_its_errors(auto_run):
    from quantcli.nn.tensor_quantizer import quantizers

    model, summary, _, ref = auto_run
    inputs = [n for n in quantizers(model) if n.endswith("input_quantizer")]
    assert sorted(summary.auto) == sorted(inputs)
    for name, a in summary.auto.items():
        assert a["method"] in CANDIDATES
        assert set(a["errors"]) == set(CANDIDATES)
        assert float(quantizers(model)[name].amax) == pytest.approx(a["candidates"][a["method"]])
        # the candidates are what the plain methods give
        assert a["candidates"]["max"] == pytest.approx(float(ref["max"][name]))
        assert a["candidates"]["percentile"] == pytest.approx(float(ref["percentile"][name]))


def test_choice_minimises_the_independent_layer_output_error(auto_run):
    from sample_models import text_encoder

    model, summary, batches, _ = auto_run
    flt = text_encoder.build()
    layers = {n: m for n, m in flt.named_modules() if isinstance(m, torch.nn.Linear)}
    seen = {n: [] for n in layers}
    hooks = [
        m.register_forward_pre_hook(lambda mod, a, n=n: seen[n].append(a[0].reshape(-1, a[0].shape[-1])))
        for n, m in layers.items()
    ]
    with torch.inference_mode():
        for b in batches:
            flt(**b)
    for h in hooks:
        h.remove()
    errs, power = {}, {}
    for name, a in summary.auto.items():
        layer = name.rsplit(".", 1)[0]
        lin = layers[layer]
        x = torch.cat(seen[layer])
        w, bias = lin.weight.detach(), lin.bias.detach()
        w_amax = w.abs().amax(dim=1, keepdim=True)
        wq = _fq(w, w_amax)
        y = F.linear(x, w, bias).double()
        power[name] = float((y**2).mean())
        errs[name] = err = {
            m: float(
                (
                    (F.linear(_fq(x, torch.tensor(v)), wq, _int32_bias(bias, v, w_amax)).double() - y) ** 2
                ).mean()
            )
            for m, v in a["candidates"].items()
        }
        for m in CANDIDATES:  # the reported errors are these errors (to float rounding of the two passes)
            assert a["errors"][m] == pytest.approx(err[m], rel=1e-4, abs=1e-12), (name, m)
    picked_not_max = alone_differs = 0
    for name, a in summary.auto.items():
        group = [name, *a.get("shared_with", [])]
        if len(group) == 1:  # a layer reading a tensor no other quantizer reads: its own smallest error
            expected = choose(errs[name])
        else:  # q, k and v read one tensor: the smallest sum of relative errors, one pick for the three
            assert sorted(group) == sorted(f"{name.rsplit('.', 2)[0]}.{p}.input_quantizer" for p in QKV)
            rel = {m: sum(errs[n][m] / power[n] for n in group) for m in CANDIDATES}
            expected = choose(rel)
            assert rel[expected] <= rel["max"] * (1 + 1e-6), name  # never worse than max, over the group
            alone_differs += choose(errs[name]) != expected
        assert a["method"] == expected, name
        picked_not_max += a["method"] != "max"
    assert picked_not_max >= 1  # the choice is made per quantizer, not a fixed one
    assert alone_differs >= 1  # the test tells a joint choice from choices one by one


def test_cli_reports_auto_choices(tmp_path):
    r = cli(
        "calibrate",
        "text_encoder",
        "--method",
        "auto",
        "--num-samples",
        "64",
        "--out",
        tmp_path / "a.pt",
        "--json",
    )
    assert r.exit_code == 0, r.output
    d = json.loads(r.stdout)
    assert d["method"] == "auto" and len(d["auto"]) == 13
    r = cli(
        "calibrate", "text_encoder", "--method", "auto", "--num-samples", "64", "--out", tmp_path / "a.pt"
    )
    assert "auto choices" in r.output


def test_candidates_are_compared_on_the_layers_own_input():
    """The layer's input, not its quantizer's, is what auto runs the layer on again: a Conv whose quantizer
    runs before its zero padding reads the padded map (it crashed on the unpadded one: MobileNetV2's
    TensorFlow padding), and a Linear with SmoothQuant's Mul reads the unsmoothed input (it was smoothed
    twice). The errors are recomputed independently, as above."""
    from quantcli.calibration.calibrate import calibrate
    from quantcli.nn import quantize_model, smooth

    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.pad, self.conv = torch.nn.ZeroPad2d(1), torch.nn.Conv2d(3, 4, 3)
            self.head = torch.nn.Linear(4 * 4 * 4, 5)

        def forward(self, x):
            return self.head(torch.flatten(self.conv(self.pad(x)), 1))

    def build():
        torch.manual_seed(0)
        return Net().eval()

    g = torch.Generator().manual_seed(1)
    batches = [{"x": torch.randn(4, 3, 4, 4, generator=g) * (1 + 3 * torch.rand(3, 1, 1, generator=g))}]
    model = quantize_model(build(), SYMMETRIC, example=batches[0])
    assert model.quantcli_report.placement.input_before == {"conv": "pad"}
    factor = torch.linspace(0.25, 4.0, 64)
    smooth.attach(model.head, factor)
    summary = calibrate(model, batches, "auto", device="cpu")

    flt = build()
    x = batches[0]["x"]
    x_pad = F.pad(x, (1, 1, 1, 1))
    with torch.no_grad():
        flat = torch.flatten(flt.conv(x_pad), 1) * factor  # the head's smoothed input (weight unchanged)
    layers = {"head": (flt.head, flat, F.linear), "conv": (flt.conv, x_pad, F.conv2d)}
    for name, (layer, inp, op) in layers.items():
        a = summary.auto[f"{name}.input_quantizer"]
        w, bias = layer.weight.detach(), layer.bias.detach()
        w_amax = w.abs().amax(dim=tuple(range(1, w.dim())), keepdim=True)
        y = op(inp, w, bias).double()
        err = {
            m: float(
                (
                    (op(_fq(inp, torch.tensor(v)), _fq(w, w_amax), _int32_bias(bias, v, w_amax)).double() - y)
                    ** 2
                ).mean()
            )
            for m, v in a["candidates"].items()
        }
        assert len(set(err.values())) > 1, name  # the candidates differ: the comparison can tell them apart
        for m in CANDIDATES:
            assert a["errors"][m] == pytest.approx(err[m], rel=1e-4, abs=1e-12), (name, m)


def test_asymmetric_quantizers_choose_among_ranges():
    """An asymmetric input quantizer (``uint8-asymmetric``) gets a choice too, among ranges: the data's
    ``(min, max)``, the two-sided percentile and mse ranges (tests/test_two_sided.py) and the range clipped at
    ``|x|``'s entropy threshold (it had no entropy candidate: 23.8 dB where entropy reached 35.4 on a user's
    MLP with an outlier channel); each candidate's error
    is recomputed here with a hand-written affine fake quantization, and the quantizer holds the pick's
    ``(amin, amax)``. Before, ``--method auto`` left asymmetric quantizers out."""
    from quantcli.calibration.calibrate import calibrate
    from quantcli.nn import quantize_model

    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = torch.nn.Linear(32, 6)

        def forward(self, x):
            return self.fc(x)

    torch.manual_seed(0)
    flt = Net().eval()
    g = torch.Generator().manual_seed(2)
    x = torch.randn(512, 32, generator=g) * 2 + 0.7
    x = torch.where(x > 0, x, 0.3 * x)
    x[0, 0] = 40.0  # one outlier: the data's max is a poor range
    model = quantize_model(Net(), {"preset": "uint8-asymmetric", "cpu": "x86-vnni"})
    model.load_state_dict(flt.state_dict(), strict=False)
    summary = calibrate(model, [{"x": x[i : i + 128]} for i in range(0, 512, 128)], "auto", device="cpu")
    a = summary.auto["fc.input_quantizer"]
    assert set(a["candidates"]) == {"max", "percentile", "mse", "entropy"}
    assert a["candidates"]["max"] == float(x.max()) and a["candidate_amin"]["max"] == float(x.min())
    # entropy: the data's range clipped at |x|'s entropy threshold, the amax a symmetric quantizer's entropy
    # search gives on the same data (its |x| histogram has the same bins)
    sym = quantize_model(Net(), {"preset": "int8", "asymmetric_activations": False, "cpu": "x86-vnni"})
    sym.load_state_dict(flt.state_dict(), strict=False)
    calibrate(sym, [{"x": x[i : i + 128]} for i in range(0, 512, 128)], "entropy", device="cpu")
    t = float(sym.fc.input_quantizer.amax)
    assert t < float(x.max())  # the threshold clips the outlier
    assert a["candidates"]["entropy"] == min(t, float(x.max()))
    assert a["candidate_amin"]["entropy"] == max(-t, float(x.min()))

    w, bias = flt.fc.weight.detach(), flt.fc.bias.detach()
    w_amax = w.abs().amax(dim=1, keepdim=True)
    y = F.linear(x, w, bias).double()
    err = {}
    for m, hi in a["candidates"].items():
        lo = a["candidate_amin"][m]
        s = (torch.tensor(hi, dtype=torch.float32) - torch.tensor(lo, dtype=torch.float32)) / 255
        zp = torch.round(-torch.tensor(lo, dtype=torch.float32) / s)
        xq = (torch.clamp(torch.round(x / s) + zp, 0, 255) - zp) * s
        unit = s * (w_amax.reshape(-1).to(torch.float32) / 127)
        bq = torch.round(bias / unit) * unit
        err[m] = float(((F.linear(xq, _fq(w, w_amax), bq).double() - y) ** 2).mean())
    assert len(set(err.values())) == 4
    for m in err:
        assert a["errors"][m] == pytest.approx(err[m], rel=1e-4), m
    pick = min(err, key=err.get)
    assert a["method"] == pick != "max"
    q = model.fc.input_quantizer
    assert float(q.amax) == a["candidates"][pick] and float(q.amin) == a["candidate_amin"][pick]


def test_quantizers_of_one_tensor_take_one_choice_and_the_producer_fuses(tmp_path):
    """A residual block's first Conv and the residual Add's quantizer read one tensor (the stem's output). The
    Conv's own choice here is percentile (its weights read the channel with rare large values), the Add's
    quantizer has no layer to choose by: chosen one by one, the tensor got two ranges, so the export quantized
    it twice and onnxruntime ran the stem as a float FusedConv. One tensor now takes one choice: one range,
    one shared Q, the stem a QLinearConv (in onnxruntime's own optimized graph)."""
    import collections

    from exporters import export_onnx
    from exporters.onnxruntime.fusion import optimized_graph
    from quantcli.calibration.calibrate import calibrate
    from quantcli.nn import quantize_model

    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.stem = torch.nn.Conv2d(3, 8, 3, padding=1)
            self.conv1 = torch.nn.Conv2d(8, 8, 3, padding=1)
            self.conv2 = torch.nn.Conv2d(8, 8, 3, padding=1)
            self.head = torch.nn.Linear(8, 5)

        def forward(self, x):
            x = torch.relu(self.stem(x))
            x = torch.relu(self.conv2(torch.relu(self.conv1(x))) + x)
            return self.head(x.mean((2, 3)))

    torch.manual_seed(0)
    net = Net().eval()
    with torch.no_grad():
        net.conv1.weight[:, 1:] *= 0.05
    g = torch.Generator().manual_seed(0)
    x = torch.randn(64, 3, 8, 8, generator=g) + (torch.rand(64, 1, 8, 8, generator=g) < 0.01) * 30.0
    batches = [{"x": x[i : i + 16]} for i in range(0, 64, 16)]
    model = quantize_model(net, {"cpu": "x86-vnni"}, example=batches[0])
    summary = calibrate(model, batches, "auto", device="cpu")
    a = summary.auto["conv1.input_quantizer"]
    assert a["shared_with"] == ["residual_quantizer"]
    assert a["method"] != "mse"  # not what the Add's quantizer would take alone: the test tells them apart
    assert float(model.residual_quantizer.amax) == float(model.conv1.input_quantizer.amax) == a["amax"]
    assert "shared_with" not in summary.auto["conv2.input_quantizer"]
    path = tmp_path / "res.onnx"
    export_onnx(model, batches[0], path)
    ops = collections.Counter(n.op_type for n in optimized_graph(path).graph.node)
    assert ops["QLinearConv"] == 3 and ops["QLinearAdd"] == 1 and ops["FusedConv"] + ops["Conv"] == 0, ops
