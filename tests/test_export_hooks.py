"""Export hooks (quantcli.nn.export_hooks): set for a block, used by forward while set, gone afterwards even
when the block (or the dynamo export around it) fails."""

import pytest
import torch
from torch import nn

from exporters import export_onnx
from quantcli.calibration.calibrate import calibrate
from quantcli.errors import ExportError
from quantcli.nn.export_hooks import export_hooks
from quantcli.nn.modules import QuantMixin
from quantcli.nn.replace import quantize_model
from quantcli.nn.tensor_quantizer import quantizers
from quantcli.quant import arithmetic


class _ConvNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3)
        self.fc = nn.Linear(4 * 6 * 6, 5)

    def forward(self, x):
        return self.fc(torch.relu(self.conv(x)).flatten(1))


def _calibrated(config="int8") -> tuple[nn.Module, dict[str, torch.Tensor]]:
    torch.manual_seed(0)
    model = _ConvNet().eval()
    batches = [{"x": torch.randn(2, 3, 8, 8)} for _ in range(3)]
    quantize_model(model, config, example=batches[0])
    calibrate(model, batches, "max", device="cpu")
    return model, batches[0]


def _hooks_left(model: nn.Module) -> list[str]:
    return [
        f"{n}.{h}"
        for n, m in model.named_modules()
        for h in ("export_hook", "bias_export_hook")
        if h in m.__dict__
    ]


def test_a_hook_replaces_the_quantizer_while_set_and_is_removed_when_the_block_raises():
    model, example = _calibrated()
    with torch.no_grad():
        before = model(**example)
    q = model.fc.input_quantizer
    seen = []
    with pytest.raises(RuntimeError, match="boom"):
        with export_hooks([(q, "export_hook", lambda x: seen.append(x.shape) or torch.zeros_like(x))]):
            with torch.no_grad():
                inside = model(**example)
            raise RuntimeError("boom")
    assert seen == [torch.Size([2, 144])]
    # fc saw zeros in place of its quantized input, so every row of the output is the same (its bias)
    assert torch.equal(inside, inside[:1].expand_as(inside))
    assert not torch.equal(before, before[:1].expand_as(before))
    assert _hooks_left(model) == []
    with torch.no_grad():
        assert torch.equal(model(**example), before)


def test_an_unknown_hook_is_refused_and_the_ones_set_before_it_are_removed():
    model, _ = _calibrated()
    q = model.fc.input_quantizer
    with pytest.raises(ValueError, match="has no export hook 'bias_export_hook'"):
        with export_hooks(
            [(model.conv, "bias_export_hook", lambda: None), (q, "bias_export_hook", lambda: None)]
        ):
            pass
    assert _hooks_left(model) == []


def test_dynamo_export_traces_through_the_hooks_and_removes_them_when_it_fails(tmp_path, monkeypatch):
    model, example = _calibrated()
    assert model.conv.int32_bias  # the onnxruntime target gives the Conv an int32 bias
    during = {}

    def failing_export(m, *args, **kwargs):
        during["quantizers"] = {n for n, q in quantizers(m).items() if "export_hook" in q.__dict__}
        during["biases"] = {
            n: mod.bias_export_hook()
            for n, mod in m.named_modules()
            if isinstance(mod, QuantMixin) and "bias_export_hook" in mod.__dict__
        }
        raise RuntimeError("the tracer gave up")

    monkeypatch.setattr(torch.onnx, "export", failing_export)
    with pytest.raises(ExportError, match="the tracer gave up"):
        export_onnx(model, example, tmp_path / "m.onnx", exporter="dynamo")
    enabled = {n for n, q in quantizers(model).items() if q.enabled}
    assert during["quantizers"] == enabled and enabled
    # the int32 bias the hook adds: bias rounded to the grid of x_scale * w_scale (half a step at most)
    step = arithmetic.bias_scale(
        model.conv.input_quantizer.integer_scale(), model.conv.weight_quantizer.integer_scale()
    )
    got = during["biases"]["conv"]
    assert torch.all((got - model.conv.bias.detach()).abs() <= step / 2 + 1e-7)
    assert not torch.equal(got, model.conv.bias.detach())
    assert _hooks_left(model) == []
    assert not list(tmp_path.iterdir())  # no half-written file
