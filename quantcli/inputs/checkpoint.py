"""The calibrated checkpoint: one self-contained file, readable with ``torch.load(weights_only=True)``.

Keys: ``format`` (``"quantcli.calibrated"``), ``format_version``, ``quantcli_version``, ``model`` (spec; the
factory file's source for file specs; ``extra``: a pickled module's bytes and sha256, or a Hugging Face
folder's config, class and outputs), ``state_dict`` (weights and every quantizer's amax), ``quant_config``,
``quantizers`` (name -> descriptor fields, enabled, amax), ``batchnorm_folds`` (the ``{layer, batchnorm}``
pairs folded: the state dict describes the folded model), ``original`` (the model as loaded, before any
transformation: its state dict's ``keys`` and the ``changed`` entries, those that BatchNorm folding,
SmoothQuant or another rewrite removed or changed; the rest equals ``state_dict``), optionally ``unrounded``
(with ``--weight-method gptq``: the weights as they were before GPTQ moved them while rounding), ``inputs``
(names, dtypes, shapes, example batch), ``calibration`` (settings and summary), optionally ``preprocessing``
(text/image data) and ``kv_cache`` (a causal LM's int8 KV cache scales). Written atomically.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from quantcli import __version__
from quantcli.errors import CheckpointError, ConfigError, QuantCliError, few, first_line
from quantcli.files import atomic_write, readable_file
from quantcli.inputs.batch_axes import batch_axes, take, unbatched
from quantcli.inputs.data import Batch, checked_batch, has_signature
from quantcli.inputs.loading import build_model
from quantcli.inputs.model_spec import ModelSpec
from quantcli.nn.config import QuantConfig
from quantcli.nn.fold_bn import restore_folds
from quantcli.nn.forward_call import call_forward
from quantcli.nn.modes import keep_float
from quantcli.nn.replace import quantize_model
from quantcli.nn.smooth import restore as restore_smoothing
from quantcli.nn.tensor_quantizer import quantizers, uncalibrated
from quantcli.quant.descriptor import QuantDescriptor, to_plain

FORMAT = "quantcli.calibrated"
FORMAT_VERSION = 2  # 2: batchnorm_folds (a folded state dict does not fit the unfolded model)
EXAMPLE_SAMPLES = 8


def example_of(batch: Batch, model: nn.Module | None = None) -> Batch:
    """The example batch a checkpoint stores: the first samples of ``batch`` (each input cut along its own
    batch axis; the whole batch where an input has none, :mod:`quantcli.inputs.batch_axes`), on the CPU.
    ``quantize_model`` reads the model's structure from a forward on it, at calibration and again when the
    checkpoint is loaded.

    Where the batch size is also the size of another axis of an input (a graph's ``(nodes, nodes)``
    adjacency beside its ``(nodes, features)`` features: the samples are on both axes) and ``model`` is
    given, the cut batch is run through it first, and the whole batch is the example where that forward
    fails (cut on axis 0 alone, the adjacency no longer fits the features)."""
    axes = batch_axes(batch)
    if not unbatched(batch, axes):
        cut = take(batch, 0, EXAMPLE_SAMPLES, axes)
        if model is None or not _samples_on_two_axes(batch, axes) or _runs(model, cut):
            batch = cut
    return {k: v.detach().cpu().clone() for k, v in batch.items()}


def _samples_on_two_axes(batch: Batch, axes: dict) -> bool:
    """Whether an input has the batch size on an axis besides its batch axis (and the batch is cut)."""
    n = next((int(batch[k].shape[a]) for k, a in axes.items() if a is not None), 0)
    return n > EXAMPLE_SAMPLES and any(
        a is not None and sum(s == n for s in batch[k].shape) > 1 for k, a in axes.items()
    )


def _runs(model: nn.Module, batch: Batch) -> bool:
    """Whether ``model``'s forward runs on ``batch`` (moved to the model's device; no gradients; its
    quantizers, calibrated or not, standing aside)."""
    from quantcli.nn.modes import quantizer_modes
    from quantcli.nn.module_outputs import on_device_of, same_randomness
    from quantcli.nn.recorded_graph import FORWARD_ERRORS

    try:
        with torch.no_grad(), same_randomness(), quantizer_modes(model, "disabled"):
            call_forward(model, on_device_of(model, batch))
    except FORWARD_ERRORS:
        return False
    return True


def state_snapshot(model: nn.Module) -> dict[str, torch.Tensor]:
    """A copy of ``model``'s state dict (on the CPU): the model as loaded, kept before quantcli transforms
    it."""
    return {k: v.detach().cpu().clone() for k, v in model.state_dict().items()}


def changed_entries(
    before: dict[str, torch.Tensor], final: dict[str, torch.Tensor]
) -> dict[str, torch.Tensor]:
    """The entries of ``before`` that ``final`` lacks or holds with another shape, dtype or value."""
    return {
        k: v
        for k, v in before.items()
        if k not in final
        or final[k].shape != v.shape
        or final[k].dtype != v.dtype
        or not torch.equal(final[k], v)
    }


def original_entries(original: dict[str, torch.Tensor], final: dict[str, torch.Tensor]) -> dict[str, Any]:
    """What the checkpoint stores of the model as loaded: every key, and the entries ``final`` lacks or
    changed."""
    return {"keys": list(original), "changed": changed_entries(original, final)}


def save_calibrated(
    path: str | Path,
    model: nn.Module,
    spec: ModelSpec,
    example_batch: Batch,
    calibration: dict[str, Any] | None = None,
    preprocessing: dict[str, Any] | None = None,
    original: dict[str, torch.Tensor] | None = None,
    unrounded: dict[str, torch.Tensor] | None = None,
    kv_cache: dict[str, Any] | None = None,
) -> None:
    """Write the calibrated checkpoint for a quantized, calibrated ``model``.

    ``preprocessing`` (from :func:`quantcli.inputs.data.load_data`) records how text or images became tensors,
    so that verify repeats it: tokenizer files and max length, or image size, mean and std. ``original``: the
    state dict of the model as loaded (:func:`state_snapshot`), so that verify compares with it rather than
    with what quantcli's transformations made of it. ``unrounded``: the state dict before weight rounding
    (``--weight-method gptq`` moves float weights as it rounds them: part of quantization, not a float
    transformation), so that :meth:`Calibrated.transformed_float_model` describes the float model quantcli's
    transformations made. ``kv_cache``: a causal LM's int8 KV cache scales (``calibrate --kv-cache``), which
    ``export`` writes into its decode graph.
    """
    if not isinstance(spec, ModelSpec):
        raise ConfigError(
            f"save_calibrated's spec is the ModelSpec the model was loaded from (load_model(...)[1], or "
            f"quantcli.inputs.loading.parse_spec({spec!r}) for a spec string), got {type(spec).__name__}"
        )
    example_batch = checked_batch(example_batch, "save_calibrated's example_batch")
    missing = uncalibrated(model)
    if missing:  # export and verify would refuse the file; say so before writing it
        raise ConfigError(
            f"save_calibrated: quantizer(s) without an amax: {few(missing)}; calibrate the "
            "model first (quantcli.calibration.calibrate.calibrate(model, batches))"
        )
    cfg: QuantConfig = getattr(model, "quantcli_config", None) or QuantConfig()
    qs = {}
    for name, q in quantizers(model).items():
        qs[name] = {
            "descriptor": to_plain(q.desc.dict()),
            "enabled": q.enabled,
            "amax": None if q.amax is None else q.amax.detach().cpu().clone(),
        }
    example = example_of(example_batch, model)
    data = {
        "format": FORMAT,
        "format_version": FORMAT_VERSION,
        "quantcli_version": __version__,
        "model": spec.to_plain(),
        "state_dict": (state := {k: v.detach().cpu().clone() for k, v in model.state_dict().items()}),
        "quant_config": cfg.to_plain(),
        "quantizers": qs,
        "batchnorm_folds": list(getattr(model, "quantcli_folded_batchnorm", [])),
        # what the placement read the model's structure from ("recorded": a forward on inputs.example)
        "placement_graph": getattr(
            getattr(getattr(model, "quantcli_report", None), "placement", None), "graph", "fx"
        ),
        "inputs": {
            "names": list(example),
            "dtypes": [str(v.dtype).replace("torch.", "") for v in example.values()],
            "shapes": [list(v.shape) for v in example.values()],
            "example": example,
        },
        "calibration": calibration or {},
    }
    if preprocessing is not None:
        data["preprocessing"] = preprocessing
    if original is not None:
        data["original"] = original_entries(original, state)
    if unrounded is not None:
        data["unrounded"] = changed_entries(unrounded, state)
    if kv_cache is not None:
        data["kv_cache"] = kv_cache
    atomic_write(path, lambda tmp: torch.save(data, tmp))


@dataclass
class Calibrated:
    """A loaded checkpoint: the quantized model (eval mode, on CPU) and everything stored with it."""

    model: nn.Module
    spec: ModelSpec
    config: QuantConfig
    data: dict[str, Any]
    path: str
    trust_code: bool = False  # whether the model code may run again (the float reference rebuilds the model)

    @property
    def input_names(self) -> list[str]:
        return list(self.data["inputs"]["names"])

    @property
    def example(self) -> Batch:
        return dict(self.data["inputs"]["example"])

    @property
    def quantizer_info(self) -> dict[str, dict[str, Any]]:
        return self.data["quantizers"]

    @property
    def kv_cache(self) -> dict[str, Any] | None:
        """A causal LM's int8 KV cache scales (``calibrate --kv-cache``), as stored; None for a float
        cache."""
        return self.data.get("kv_cache")

    @property
    def has_original(self) -> bool:
        """Whether the checkpoint stores the model as loaded (written by a quantcli that keeps it)."""
        return "original" in self.data

    def float_model(self) -> nn.Module:
        """The unquantized reference: the model as loaded, before BatchNorm folding, SmoothQuant or any other
        rewrite quantcli applied (eval mode, CPU); for a checkpoint without it,
        :meth:`transformed_float_model`."""
        if not self.has_original:
            return self.transformed_float_model()
        model = build_model(self.spec, trust_code=self.trust_code, origin=self.path)
        original = self.data["original"]
        state = {
            k: original["changed"][k] if k in original["changed"] else self.data["state_dict"][k]
            for k in original["keys"]
        }
        try:
            model.load_state_dict(state, strict=True)
        except RuntimeError as e:
            raise CheckpointError(
                f"{self.path}: the stored original weights do not fit the model built from "
                f"{self.spec.spec}: {first_line(e)}"
            ) from None
        return model.eval()

    def transformed_float_model(self) -> nn.Module:
        """A copy of the quantized model with every quantizer disabled: the model as quantcli transformed
        it."""
        m = copy.deepcopy(self.model)
        if self.data.get("unrounded"):  # the weights as they were before GPTQ moved them while rounding
            m.load_state_dict(self.data["unrounded"], strict=False)
        for q in quantizers(m).values():
            q.set_mode("disabled")
        return m

    def evaluation_batches(self) -> list[Batch] | None:
        """The sample model's held-out batches, if the model is a sample model."""
        if self.spec.kind != "sample":
            return None
        from sample_models import SAMPLES

        return SAMPLES[self.spec.spec].evaluation_batches()


def read_checkpoint(path: str | Path) -> dict[str, Any]:
    path = Path(path)
    readable_file(
        path,
        "calibrated checkpoint",
        ".calib.pt",
        "the .calib.pt file that `quantcli calibrate` wrote",
        CheckpointError,
    )
    try:
        data = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:
        # a file torch.save did not write fails deep in the unpickler (a KeyError naming a byte, or torch's
        # weights_only advice), neither of which says what is wrong: say it, and what the file looks like
        with open(path, "rb") as f:
            head = f.read(2)
        if head == b"\x08\x07" or path.suffix.lower() == ".onnx":  # an ONNX ModelProto starts with ir_version
            why = "it looks like an ONNX graph; pass the .calib.pt file that `quantcli calibrate` wrote"
        elif not has_signature(path, ".pt"):  # torch.save: a zip, or a legacy pickle
            why = "it is not a file written by torch.save; create one with `quantcli calibrate`"
        else:
            why = f"cannot read it: {first_line(e, 120)}; create one with `quantcli calibrate`"
        raise CheckpointError(f"{path} is not a quantcli calibrated checkpoint ({why})") from None
    if not isinstance(data, dict) or data.get("format") != FORMAT:
        raise CheckpointError(
            f"{path} is not a quantcli calibrated checkpoint; create one with `quantcli calibrate`"
        )
    version = data.get("format_version", 0)
    if not isinstance(version, int):
        raise CheckpointError(f"{path} is damaged: format_version is {type(version).__name__}, not a number")
    if version > FORMAT_VERSION:
        raise CheckpointError(
            f"{path} was written by a newer quantcli (format {data['format_version']}); upgrade quantcli"
        )
    _check_layout(path, data)
    return data


MODEL_KINDS = ("sample", "file", "module", "pickle", "hf")  # quantcli.inputs.loading.ModelSpec.kind
#: the entries every checkpoint has, and the type of each (``inputs`` also: its names, dtypes and example)
_LAYOUT = {"model": dict, "state_dict": dict, "quant_config": dict, "quantizers": dict, "inputs": dict}
_INPUTS = {"names": list, "dtypes": list, "example": dict}


def _check_layout(path: Path, data: dict[str, Any]) -> None:
    """A damaged or hand-edited checkpoint fails here with the entry named, not deep in the loading code."""
    for where, layout, d in (("", _LAYOUT, data), ("inputs.", _INPUTS, data.get("inputs"))):
        for key, kind in layout.items():
            if not isinstance(d.get(key), kind):
                state = "missing" if key not in d else f"a {type(d[key]).__name__}, not a {kind.__name__}"
                raise CheckpointError(
                    f"{path} is damaged: its entry {where}{key!r} is {state}; re-create it "
                    "with `quantcli calibrate`"
                )
    bad = [
        name
        for name, q in data["quantizers"].items()
        if not (
            isinstance(q, dict)
            and isinstance(q.get("descriptor"), dict)
            and isinstance(q.get("enabled"), bool)
        )
    ]
    if bad:
        raise CheckpointError(
            f"{path} is damaged: quantizer entry {bad[0]!r} lacks its descriptor or "
            f"enabled flag; "
            "re-create it with `quantcli calibrate`"
        )
    model = data["model"]
    if model.get("kind") not in MODEL_KINDS or not isinstance(model.get("spec"), str):
        raise CheckpointError(
            f"{path} is damaged: its model entry has no kind and spec; re-create it with `quantcli calibrate`"
        )


def load_calibrated(path: str | Path, trust_code: bool = False) -> Calibrated:
    """Re-create the quantized model exactly: same outputs, bit for bit, as when it was saved.

    Model code that came inside the checkpoint (a factory file's stored source when the file is not on disk
    unchanged, a pickled whole module) runs only with ``trust_code=True``; otherwise
    :class:`quantcli.errors.UntrustedCodeError` is raised and nothing is executed.
    """
    data = read_checkpoint(path)
    spec = ModelSpec.from_plain(data["model"])
    try:
        cfg = QuantConfig.from_plain(data["quant_config"])
    except (TypeError, ValueError, AttributeError, KeyError, ConfigError) as e:
        raise CheckpointError(
            f"{path} is damaged: its quant_config cannot be read ({type(e).__name__}: "
            f"{first_line(e, 120)}); re-create it with `quantcli calibrate`"
        ) from None
    if "asymmetric_activations" not in data["quant_config"]:
        # written before the onnxruntime target's asymmetric activations: its grids were symmetric
        cfg.asymmetric_activations = False
    if "target" not in data["quant_config"]:
        # written before targets existed: rebuild the placement it was calibrated with
        cfg.legacy_placement = True
    stored_placement = (data.get("calibration") or {}).get("placement")
    if isinstance(stored_placement, dict) and "activation_quantized" not in stored_placement:
        # written before sigmoids, multiplications and global poolings were quantized (issue 35): rebuild
        # the placement without those quantizers, which its state dict does not have
        cfg.legacy_activations = True
    if isinstance(stored_placement, dict) and "functional_pools" not in stored_placement:
        # written before a global pooling a forward computes (x.mean((2, 3))) was read as one: rebuild the
        # placement without the quantizers that reading adds
        cfg.legacy_functional_pools = True
    if "cpu" not in data["quant_config"] and cfg.reduce_range == "auto":
        # written before the deployment CPU was recorded: its weights kept every bit unless it said otherwise
        cfg.reduce_range = False
    model = build_model(spec, trust_code=trust_code, origin=str(path))
    if "batchnorm_folds" not in data:  # written before BatchNorm folding existed: nothing was folded
        cfg.fold_batchnorm = False
    try:
        # the stored state dict holds the folded weights; rebuild the folded structure, recompute nothing
        restore_folds(model, data.get("batchnorm_folds", []))
    except QuantCliError as e:
        raise CheckpointError(f"{path}: {e}") from None
    # the placement is read again as at calibration: from a forward on the stored example (older checkpoints:
    # fx)
    recorded = data.get("placement_graph") == "recorded"
    # with the calibrated weights, so that a forward whose path depends on values takes the same one
    if recorded:
        own = model.state_dict()
        model.load_state_dict(
            {k: v for k, v in data["state_dict"].items() if k in own and own[k].shape == v.shape},
            strict=False,
        )
    # layers calibrate's float check left as loaded stay float; the check itself ran at calibration
    reverted = (data.get("calibration") or {}).get("float_check", {}).get("reverted", [])
    keep = [r["layer"] for r in reverted if isinstance(r, dict) and r.get("kind") == "layer"]
    quantize_model(
        model,
        cfg,
        fold=False,
        example=data["inputs"]["example"] if recorded else None,
        keep_float=keep,
        check_float=False,
    )
    # SmoothQuant's explicit Muls, if any, before their weights load
    restore_smoothing(model, data["state_dict"])
    try:
        model.load_state_dict(data["state_dict"], strict=True)
    except RuntimeError as e:
        raise CheckpointError(
            f"{path}: the stored weights do not fit the model built from {spec.spec}: {first_line(e)}"
        ) from None
    stored = data["quantizers"]
    for name, q in quantizers(model).items():
        if name not in stored or not stored[name]["enabled"]:
            # off in the file (a layer that never ran during calibration), or placed by this version's rules
            # but not by the one that wrote it (an output quantizer added since): the file records what was
            # calibrated, and the graph is the one it describes
            keep_float(q)
        else:
            if stored[name]["descriptor"].get("dynamic") and not q.desc.dynamic:
                # a layer --min-cosine moved to dynamic int8 activations
                # (quantcli.calibration.mixed_precision)
                q.desc = QuantDescriptor(**stored[name]["descriptor"])
            q.set_mode("quantize")
    return Calibrated(model.eval(), spec, cfg, data, str(path), trust_code)
