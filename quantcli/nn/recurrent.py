"""Recurrent layers: ``nn.LSTM`` in int8 as onnxruntime runs it, ``nn.GRU``/``nn.RNN`` float with the reason.

onnxruntime has one integer recurrent kernel, ``com.microsoft::DynamicQuantizeLSTM`` (CPU), which its own
``quantize_dynamic`` writes for every ``LSTM`` node (``onnxruntime/python/tools/quantization/operators/
lstm.py``; the kernel: ``contrib_ops/cpu/quantization/dynamic_quantize_lstm.cc`` on the LSTM of
``providers/cpu/rnn/uni_directional_lstm.cc``). Its weights ``W`` and ``R`` are int8 codes, symmetric (zero
point 0), with one float32 scale per direction or per output row (gate unit); its activations are quantized
at run time, uint8 with a scale and zero point from each tensor's own minimum and maximum (as ONNX
``DynamicQuantizeLinear``): the input sequence of a direction as one tensor (all steps and samples, before
the input GEMM), and the hidden state before each step's recurrent GEMM (all samples). Integer products are
summed exactly and scaled once; biases, gates and the cell state stay float. There is no ``GRU`` or ``RNN``
counterpart, so those stay float and the report says why.

:class:`QuantLSTM` is that computation in PyTorch: ``nn.LSTM`` with one weight quantizer per weight
(``<lstm>.l<k>.weight_ih_quantizer``, ``..._hh_...``, ``..._ih_reverse_...``), each ``dynamic`` (its amax is
the weight's own max |w| per row, what max calibration of a weight gives, recomputed from the weight: nothing
to store). With the quantizers off it is the float ``nn.LSTM``. Exported (:func:`exported_weights`), it is the
float ``LSTM`` node with the dequantized weights, which :mod:`exporters.onnxruntime.recurrent` rewrites into
``DynamicQuantizeLSTM`` with the codes and scales of :func:`onnx_layers`.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator
from dataclasses import dataclass

import torch
from torch import nn

from quantcli.nn.tensor_quantizer import TensorQuantizer
from quantcli.quant import arithmetic
from quantcli.quant.descriptor import QuantDescriptor

#: PyTorch stacks an LSTM's gates as (input, forget, cell, output); ONNX as (input, output, forget, cell)
TORCH_TO_ONNX_GATES = (0, 3, 1, 2)
KINDS = ("ih", "hh")  # the input weight W, the recurrent weight R
DYNAMIC_LSTM = "DynamicQuantizeLSTM"
NO_KERNEL = (
    "onnxruntime has no integer {op} kernel (its one integer recurrent kernel is DynamicQuantizeLSTM), so it "
    "runs in float"
)


def float_reason(module: nn.Module, target: str) -> str | None:
    """Why a recurrent ``module`` stays float on ``target``; None for an LSTM that is quantized, and for a
    module that is not recurrent."""
    if not isinstance(module, nn.RNNBase):
        return None
    if type(module) not in (nn.LSTM, QuantLSTM):
        op = {nn.GRU: "GRU", nn.RNN: "RNN"}.get(type(module), type(module).__name__)
        return NO_KERNEL.format(op=op)
    if target != "onnxruntime":
        return (
            f"an int8 LSTM is onnxruntime's DynamicQuantizeLSTM; the {target} target has no integer LSTM "
            "(calibrate with --target onnxruntime for it)"
        )
    if module.proj_size:
        return "an LSTM with proj_size: ONNX's LSTM (and DynamicQuantizeLSTM) has no output projection"
    return None


class WeightView:
    """What the config reads of a layer when it resolves a weight quantizer (:meth:`QuantConfig.resolve`):
    the output-channel axis and the weight, here an LSTM's first input weight (rows: gate units). Its
    ``reduce_range`` applies as to a Linear: the kernel's activations are uint8 over their whole range, so on
    a CPU whose u8s8 kernels can saturate (x86 without VNNI) 8-bit weights become 7-bit (measured on the
    zoo's LSTM classifier, AVX2: with 8-bit weights onnxruntime's output was 0.0137 (max abs) from the model
    where the fake-quant model's was 0.0016, verify's replay 13 steps off; with 7-bit weights the graph
    computes the fake-quant model to float rounding, replay 0.0 steps)."""

    weight_axis = 0

    def __init__(self, lstm: nn.LSTM):
        self.weight = lstm.weight_ih_l0


def weight_format_reason(desc: QuantDescriptor) -> str | None:
    """Why DynamicQuantizeLSTM cannot take weights quantized as ``desc``; None when it can (symmetric integers
    of at most 8 bits, stored as int8, per tensor or per output row)."""
    if (
        desc.is_fp8
        or not isinstance(desc.num_bits, int)
        or desc.num_bits > 8
        or desc.unsigned
        or desc.asymmetric
        or desc.block_sizes
        or desc.axis not in (None, 0)
    ):
        return (
            f"DynamicQuantizeLSTM takes 8-bit symmetric integer weights, per tensor or per output row; the "
            f"config asks for {desc.format_name}"
            + (f" along axis {desc.axis}" if desc.axis not in (None, 0) else "")
            + (" blocked" if desc.block_sizes else "")
        )
    return None


def weight_names(lstm: nn.LSTM) -> list[tuple[int, int, str, str]]:
    """``(layer, direction, kind, parameter name)`` of every weight, in the order torch stores them."""
    out = []
    for k in range(lstm.num_layers):
        for d in range(2 if lstm.bidirectional else 1):
            for kind in KINDS:
                out.append((k, d, kind, f"weight_{kind}_l{k}{'_reverse' if d else ''}"))
    return out


def quantizer_attr(kind: str, direction: int) -> str:
    """The attribute of a layer's quantizer container: ``weight_ih_quantizer``, ``weight_hh_reverse_...``."""
    return f"weight_{kind}{'_reverse' if direction else ''}_quantizer"


def layer_prefix(k: int) -> str:
    """The child module holding layer ``k``'s quantizers (``l0``): quantizer names ``<lstm>.l0.<attr>``."""
    return f"l{k}"


class QuantLSTM(nn.LSTM):
    """``nn.LSTM`` computing as ``DynamicQuantizeLSTM`` where its weight quantizers are on (module
    docstring). A layer whose quantizers are not all on runs in float, and is exported in float."""

    _quantcli_exporting = False  # set by exported_weights: plain nn.LSTM forward on dequantized weights

    def weight_quantizer_of(self, k: int, direction: int, kind: str) -> TensorQuantizer:
        return getattr(getattr(self, layer_prefix(k)), quantizer_attr(kind, direction))

    def layer_quantized(self, k: int) -> bool:
        """Whether layer ``k`` runs quantized: every weight quantizer of it quantizes."""
        qs = [self.weight_quantizer_of(k, d, kind) for layer, d, kind, _ in weight_names(self) if layer == k]
        return all(q.mode == "quantize" for q in qs)

    def forward(self, input, hx=None):  # noqa: A002  (nn.LSTM's argument name)
        if self._quantcli_exporting or not any(self.layer_quantized(k) for k in range(self.num_layers)):
            return super().forward(input, hx)
        return dynamic_lstm(self, input, hx)


def convert(module: nn.LSTM, resolve) -> None:
    """Make ``module`` a :class:`QuantLSTM` in place, with a quantizer for every weight. ``resolve(path)``:
    ``(enabled, descriptor, quantizer name)`` for the quantizer at ``l<k>.<attr>`` under the module (the
    config's weight settings)."""
    module.__class__ = QuantLSTM
    for k in range(module.num_layers):
        holder = nn.Module()
        for _, d, kind, _ in (w for w in weight_names(module) if w[0] == k):
            attr = quantizer_attr(kind, d)
            enabled, desc, qname = resolve(f"{layer_prefix(k)}.{attr}")
            desc = QuantDescriptor(**{**desc.dict(), "dynamic": True})  # amax: the weight's own max |w|
            holder.add_module(attr, TensorQuantizer(desc, name=qname, enabled=enabled))
        module.add_module(layer_prefix(k), holder)


# ------------------------------------------------------------------------------------------- the computation


def _fake_dynamic(x: torch.Tensor) -> torch.Tensor:
    """uint8 per tensor, scale and zero point from ``x`` itself (what the kernel does before each GEMM)."""
    return arithmetic.fake_quant_dynamic(x)


def dynamic_lstm(lstm: QuantLSTM, input: torch.Tensor, hx=None):  # noqa: A002
    """``lstm(input, hx)`` as ``DynamicQuantizeLSTM`` computes it, layer by layer and direction by direction:
    shapes, ``batch_first``, unbatched inputs and ``(h_n, c_n)`` as ``nn.LSTM`` returns them. Layers whose
    quantizers are not all on compute in float (the same loop, no quantization)."""
    unbatched = input.dim() == 2
    x = input.unsqueeze(1) if unbatched else (input.transpose(0, 1) if lstm.batch_first else input)
    steps, batch, _ = x.shape
    dirs, hidden = (2 if lstm.bidirectional else 1), lstm.hidden_size
    if hx is None:
        zeros = x.new_zeros(lstm.num_layers * dirs, batch, hidden)
        h0, c0 = zeros, zeros
    else:
        h0, c0 = (t.unsqueeze(1) for t in hx) if unbatched else hx
    h_n, c_n = [], []
    layer_in = x
    for k in range(lstm.num_layers):
        quantized = lstm.layer_quantized(k)
        outs = []
        for d in range(dirs):
            sfx = "_reverse" if d else ""
            w_ih, w_hh = getattr(lstm, f"weight_ih_l{k}{sfx}"), getattr(lstm, f"weight_hh_l{k}{sfx}")
            if quantized:
                w_ih = lstm.weight_quantizer_of(k, d, "ih")(w_ih)
                w_hh = lstm.weight_quantizer_of(k, d, "hh")(w_hh)
            bias = None
            if lstm.bias:
                bias = getattr(lstm, f"bias_ih_l{k}{sfx}") + getattr(lstm, f"bias_hh_l{k}{sfx}")
            seq = layer_in.flip(0) if d else layer_in
            flat = seq.reshape(steps * batch, -1)
            gx = (_fake_dynamic(flat) if quantized else flat) @ w_ih.T
            gx = gx.reshape(steps, batch, -1)
            h, c = h0[k * dirs + d], c0[k * dirs + d]
            out = []
            for t in range(steps):
                gates = gx[t] + (_fake_dynamic(h) if quantized else h) @ w_hh.T
                if bias is not None:
                    gates = gates + bias
                i, f, g, o = gates.chunk(4, dim=1)
                c = torch.sigmoid(f) * c + torch.sigmoid(i) * torch.tanh(g)
                h = torch.sigmoid(o) * torch.tanh(c)
                out.append(h)
            y = torch.stack(out)
            outs.append(y.flip(0) if d else y)
            h_n.append(h)
            c_n.append(c)
        layer_in = torch.cat(outs, dim=2) if dirs > 1 else outs[0]
    output = layer_in.transpose(0, 1) if lstm.batch_first else layer_in
    output = layer_in.squeeze(1) if unbatched else output
    h_n, c_n = torch.stack(h_n), torch.stack(c_n)
    if unbatched:
        h_n, c_n = h_n.squeeze(1), c_n.squeeze(1)
    return output, (h_n, c_n)


# ------------------------------------------------------------------------------------------- export


@contextlib.contextmanager
def exported_weights(model: nn.Module) -> Iterator[None]:
    """While the block runs (an export), every :class:`QuantLSTM` is a plain ``nn.LSTM`` whose quantized
    layers hold their dequantized weights (codes times scale, float32): the exporter writes them as the
    ``LSTM`` node's ``W``/``R``, whose values the onnxruntime pass turns back into the codes. Restored
    after."""
    saved: list[tuple[nn.Parameter, torch.Tensor]] = []
    lstms = [m for m in model.modules() if isinstance(m, QuantLSTM)]
    try:
        for m in lstms:
            for k, d, kind, pname in weight_names(m):
                if m.layer_quantized(k):
                    p = getattr(m, pname)
                    with torch.no_grad():
                        deq = m.weight_quantizer_of(k, d, kind)(p.detach())
                    saved.append((p, p.data))
                    p.data = deq
            m._quantcli_exporting = True
        yield
    finally:
        for p, data in saved:
            p.data = data
        for m in lstms:
            m._quantcli_exporting = False


@dataclass
class OnnxLayer:
    """One quantized LSTM layer in the layout of an ONNX ``LSTM`` node and of ``DynamicQuantizeLSTM``.

    ``w``/``r``: the dequantized weights as the ``LSTM`` node holds them, ``(directions, 4H, in)`` and
    ``(directions, 4H, H)``, gates in ONNX order; ``w_codes``/``r_codes``: int8 codes transposed as the
    kernel takes them, ``(directions, in, 4H)`` / ``(directions, H, 4H)``; ``w_scale``/``r_scale``: float32,
    ``(directions, 4H)`` per output row or ``(directions,)`` per tensor; ``quantizers``: their names, W's then
    R's."""

    module: str
    layer: int
    w: torch.Tensor
    r: torch.Tensor
    w_codes: torch.Tensor
    r_codes: torch.Tensor
    w_scale: torch.Tensor
    r_scale: torch.Tensor
    quantizers: list[str] = dataclasses.field(default_factory=list)

    @property
    def name(self) -> str:
        """The layer as the reports name it: ``lstm.l0``."""
        return f"{self.module}.{layer_prefix(self.layer)}" if self.module else layer_prefix(self.layer)


def _onnx_rows(t: torch.Tensor) -> torch.Tensor:
    """Rows (gate blocks along dim 0) from PyTorch's gate order to ONNX's."""
    return torch.cat([t.chunk(4, dim=0)[g] for g in TORCH_TO_ONNX_GATES], dim=0)


def _codes_and_scale(q: TensorQuantizer, w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dequantized weight, int8 codes, float32 scale per row or scalar) of weight ``w`` under ``q``."""
    d = q.desc
    amax = q._dynamic_amax(w.detach()).to(torch.float32)
    scale = arithmetic.symmetric_scale(amax, arithmetic.symmetric_bound(d.num_bits, False))
    lo, hi = arithmetic.symmetric_code_bounds(amax, d.num_bits, False, d.narrow_range)
    codes = arithmetic.quantize_linear(w.detach().to(torch.float32), scale, torch.zeros_like(scale), lo, hi)
    with torch.no_grad():
        deq = q(w.detach())
    return deq, codes, scale.reshape(-1) if scale.numel() > 1 else scale.reshape(())


def onnx_layers(model: nn.Module) -> list[OnnxLayer]:
    """Every quantized LSTM layer of ``model`` in the ONNX layout (:class:`OnnxLayer`)."""
    out = []
    for name, m in model.named_modules():
        if not isinstance(m, QuantLSTM):
            continue
        for k in range(m.num_layers):
            if not m.layer_quantized(k):
                continue
            parts: dict[str, list] = {"ih": [], "hh": []}
            names: dict[str, list[str]] = {"ih": [], "hh": []}
            for layer, d, kind, pname in weight_names(m):
                if layer != k:
                    continue
                q = m.weight_quantizer_of(k, d, kind)
                deq, codes, scale = _codes_and_scale(q, getattr(m, pname))
                per_row = scale.numel() > 1
                parts[kind].append(
                    (_onnx_rows(deq), _onnx_rows(codes).T, _onnx_rows(scale) if per_row else scale)
                )
                names[kind].append(q.name)
            (w, wc, ws), (r, rc, rs) = ([torch.stack(list(x)) for x in zip(*parts[kind])] for kind in KINDS)
            codes = (wc.to(torch.int8), rc.to(torch.int8))
            out.append(OnnxLayer(name, k, w, r, *codes, ws, rs, names["ih"] + names["hh"]))
    return out


def recurrent_quantizers(model: nn.Module) -> set[str]:
    """The names of every :class:`QuantLSTM`'s weight quantizers (dynamic by construction: exported through
    :mod:`exporters.onnxruntime.recurrent`, not as Q/DQ)."""
    return {
        q.name
        for m in model.modules()
        if isinstance(m, QuantLSTM)
        for q in m.modules()
        if isinstance(q, TensorQuantizer) and q.name
    }


def precision(module: nn.Module) -> str:
    """What a :class:`QuantLSTM` runs as, for the summary."""
    layers = [k for k in range(module.num_layers) if module.layer_quantized(k)]
    if not layers:
        return "float (its weight quantizers are off)"
    which = "" if len(layers) == module.num_layers else f"layers {', '.join(map(str, layers))}: "
    bits = module.weight_quantizer_of(layers[0], 0, "ih").desc.num_bits
    weights = "int8 weights" if bits == 8 else f"{bits}-bit weights (stored as int8)"
    return f"{which}{weights}, dynamic uint8 activations ({DYNAMIC_LSTM})"
