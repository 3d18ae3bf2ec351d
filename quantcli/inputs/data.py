"""Calibration / verification data: files -> a list of keyword batches for ``model(**batch)``.

Formats: ``.npz`` (one array per forward argument, by name; ``arr_0, arr_1, ...`` positional), ``.npy`` (the
single input), ``.pt`` (a tensor, a dict of tensors, a tuple of tensors in forward's order, or a list of such
batches; read with ``weights_only=True``), or a directory of such files (one batch per file, sequence lengths
may differ).
Whole arrays are split into batches of ``batch_size``; lists and directories are used batch by batch.
float64, float16 and bfloat16 become float32 (a half-precision model is calibrated in float32:
:mod:`quantcli.inputs.precision`); integer and bool arrays (token ids, masks) pass through unchanged.
"""

from __future__ import annotations

import dataclasses
import inspect
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from quantcli import defaults
from quantcli.errors import DataError, first_line, flags_apply
from quantcli.inputs import batch_axes
from quantcli.nn.forward_call import call_forward
from quantcli.nn.fresh_inputs import fresh

Batch = dict[str, torch.Tensor]
_SUFFIXES = (".npz", ".npy", ".pt")


def forward_parameters(model: nn.Module) -> tuple[list[str], list[str], bool]:
    """(all named parameters of forward, the required ones, accepts **kwargs)."""
    sig = inspect.signature(model.forward)
    names, required, var_kw = [], [], False
    for p in sig.parameters.values():
        if p.kind is p.VAR_KEYWORD:
            var_kw = True
        elif p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY, p.POSITIONAL_ONLY):
            names.append(p.name)
            if p.default is p.empty:
                required.append(p.name)
    return names, required, var_kw


def _tensor(x, where: str) -> torch.Tensor:
    if isinstance(x, np.ndarray):
        if x.dtype == object:
            raise DataError(f"{where}: object arrays are not supported; save numeric arrays")
        x = torch.from_numpy(np.ascontiguousarray(x))
    if not isinstance(x, torch.Tensor):
        raise DataError(f"{where}: expected an array or tensor, got {type(x).__name__}")
    if x.layout != torch.strided:  # sparse (COO, CSR...): not what a model's forward or an exporter takes
        layout = str(x.layout).replace("torch.", "")
        raise DataError(f"{where}: a {layout} tensor; save it dense (x.to_dense())")
    if x.is_complex():
        raise DataError(
            f"{where}: complex values ({str(x.dtype).replace('torch.', '')}) cannot be model "
            f"inputs; "
            "save the real (or magnitude) part"
        )
    if x.dtype in (torch.float64, torch.float16, torch.bfloat16):  # models run in float32 (inputs.precision)
        x = x.to(torch.float32)
    return x


def _named(raw: dict, names: list[str], where: str) -> Batch:
    # (forward(self, *args) has no names: the batch keeps its keys, and check_names says what to change)
    positional = bool(names) and all(re.fullmatch(r"arr_\d+", k) for k in raw)
    out = {}
    for k, v in raw.items():
        if positional:
            i = int(k[4:])
            if i >= len(names):
                raise DataError(
                    f"{where}: {k} is positional argument {i}, but forward takes {len(names)} "
                    f"({', '.join(names)})"
                )
            k = names[i]
        out[k] = _tensor(v, f"{where}[{k}]")
    return out


def _read(path: Path, names: list[str], mmap: bool = False) -> tuple[list[Batch], bool]:
    """(batches, whole_arrays): whole arrays may be re-batched. ``mmap``: ``.npy`` and ``.pt`` tensors are
    memory-mapped (copy-on-write), so only the pages of the batches used are ever read."""
    where = str(path)
    suffix = path.suffix.lower()
    try:
        if suffix == ".npz":
            with np.load(path, allow_pickle=False) as z:
                raw = {k: z[k] for k in z.files}
            return [_named(raw, names, where)], True
        if suffix == ".npy":
            arr = np.load(path, allow_pickle=False, mmap_mode="c" if mmap else None)
            if not names:
                raise DataError(f"{where}: {_UNNAMED}")
            return [{names[0]: _tensor(arr, where)}], True
        if suffix == ".pt":
            obj = _load_pt(path, mmap)
        else:
            raise DataError(
                f"{where}: unknown data format {suffix!r}; use .npz, .npy, .pt or a directory of them"
            )
    except DataError:
        raise
    except Exception as e:
        # a file that is not what its suffix says fails deep in numpy's or torch's readers, whose messages
        # (pickle advice, a KeyError naming a byte) do not say so
        detail = first_line(e)
        if not has_signature(path, suffix):
            kind = {
                ".npz": "a .npz archive (numpy.savez)",
                ".npy": "a .npy array (numpy.save)",
                ".pt": "a file written by torch.save",
            }[suffix]
            raise DataError(f"cannot read {where}: it is not {kind}") from None
        raise DataError(f"cannot read {where}: {detail}") from None
    if isinstance(obj, torch.Tensor):
        return [{names[0]: _tensor(obj, where)}] if names else [], True
    if isinstance(obj, dict):
        return [_named(obj, names, where)], True
    if isinstance(obj, tuple) and len(names) > 1 and all(isinstance(t, torch.Tensor) for t in obj):
        # forward's arguments in order, as forward(*obj) takes them (an .npz's arr_0, arr_1, ...)
        if len(obj) > len(names):
            raise DataError(
                f"{where}: a tuple of {len(obj)} tensors is one batch of forward's arguments in order, but "
                f"forward takes {len(names)} ({', '.join(names)}); save a dict of name -> tensor, or a list "
                "of such batches"
            )
        return [{n: _tensor(t, f"{where}[{i}]") for i, (n, t) in enumerate(zip(names, obj))}], True
    if isinstance(obj, (list, tuple)):
        batches = []
        for i, b in enumerate(obj):
            if isinstance(b, torch.Tensor):
                batches.append({names[0]: _tensor(b, f"{where}[{i}]")})
            elif isinstance(b, dict):
                batches.append(_named(b, names, f"{where}[{i}]"))
            else:
                raise DataError(
                    f"{where}[{i}]: a batch must be a tensor or a dict of tensors, got {type(b).__name__}"
                )
        return batches, False
    raise DataError(
        f"{where}: expected a tensor, a dict of tensors or a list of batches, got {type(obj).__name__}"
    )


def has_signature(path: Path, suffix: str) -> bool:
    """Whether the file starts as its format does: a zip (.npz; .pt since torch 1.6), numpy's magic (.npy), a
    pickle protocol 2+ opcode (a legacy torch.save .pt)."""
    with open(path, "rb") as f:
        head = f.read(6)
    if suffix == ".npy":
        return head == b"\x93NUMPY"
    return head.startswith(b"PK\x03\x04") or (suffix == ".pt" and head[:1] == b"\x80")


def _load_pt(path: Path, mmap: bool):
    if mmap:
        try:
            return torch.load(path, map_location="cpu", weights_only=True, mmap=True)
        except RuntimeError:  # a file in the legacy (pre-zip) format cannot be mapped: read it whole
            pass
    return torch.load(path, map_location="cpu", weights_only=True)


def _split(batch: Batch, batch_size: int, where: str) -> list[Batch]:
    """Whole arrays cut into batches of ``batch_size`` samples, each input along its own batch axis
    (:mod:`quantcli.inputs.batch_axes`)."""
    if any(v.dim() == 0 for v in batch.values()):
        raise DataError(
            f"{where}: scalar arrays cannot be batched; give each input a leading sample dimension"
        )
    features = {k: int(v.shape[0]) for k, v in batch.items() if v.is_floating_point()}
    if len(set(features.values())) > 1:
        raise DataError(f"{where}: inputs have different sample counts {features}")
    axes = batch_axes.batch_axes(batch)
    n = batch_axes.batch_size(batch, axes)
    if n <= batch_size:
        return [batch]
    return [batch_axes.take(batch, i, i + batch_size, axes, where) for i in range(0, n, batch_size)]


#: a .npy array or an image folder for a forward without a named parameter (``forward(self, *xs)``,
#: ``forward(self, **kw)``, or none)
_UNNAMED = (
    "forward has no named parameter to pass this data to (quantcli calls forward by keyword): give it one "
    "(def forward(self, x)), or, for forward(**kw), save an .npz of the names it reads "
    "(np.savez(path, x=...))"
)


def checked_batch(batch, what: str) -> Batch:
    """``batch`` when it is one keyword batch (a mapping of input name -> tensor, as ``model(**batch)`` takes
    it); a DataError naming ``what`` and the fix for anything else (a bare tensor, a list)."""
    if isinstance(batch, Mapping) and all(isinstance(v, torch.Tensor) for v in batch.values()):
        return batch
    if isinstance(batch, Mapping):
        wrong = next(k for k, v in batch.items() if not isinstance(v, torch.Tensor))
        raise DataError(f"{what}: input {wrong!r} is a {type(batch[wrong]).__name__}, not a torch tensor")
    hint = " ({'x': tensor}, with forward's argument name)" if isinstance(batch, torch.Tensor) else ""
    raise DataError(
        f"{what} is one batch, a dict of input name -> tensor for model(**batch){hint}; got "
        f"{type(batch).__name__}"
    )


def checked_batches(batches, what: str) -> list[Batch]:
    """``batches`` as a list of keyword batches (:func:`checked_batch`); a DataError naming the fix for a
    single batch or a tensor given instead."""
    if isinstance(batches, (Mapping, torch.Tensor)) or not isinstance(batches, Sequence):
        single = " (one batch: wrap it in a list, [batch])" if isinstance(batches, Mapping) else ""
        raise DataError(
            f"{what} is a list of batches, each a dict of input name -> tensor{single}; got "
            f"{type(batches).__name__}"
        )
    return [checked_batch(b, f"{what}[{i}]") for i, b in enumerate(batches)]


def check_names(batch: Batch, model: nn.Module, where: str) -> None:
    names, required, var_kw = forward_parameters(model)
    if not names and not var_kw:
        raise DataError(
            f"{where}: forward takes no named parameter (quantcli calls forward by keyword, and "
            "forward(self, *args) takes its inputs by position): give it one per input (def forward(self, x))"
        )
    for k in batch:
        if k not in names and not var_kw:
            raise DataError(f"{where}: input {k!r} is not an argument of forward({', '.join(names)})")
    missing = [r for r in required if r not in batch]
    if missing:
        raise DataError(
            f"{where}: forward needs argument(s) {', '.join(missing)} that the data does not provide (it "
            f"has {', '.join(batch) or 'nothing'}): give each batch every input, as a dict of name -> tensor "
            "(an .npz of them) or, in a .pt, a tuple in forward's order; a list in a .pt is a list of batches"
        )


def load_batches(
    path: str | Path,
    model: nn.Module,
    batch_size: int | None = defaults.BATCH_SIZE,
    num_samples: int | None = None,
    mmap: bool = False,
) -> list[Batch]:
    """Read data for ``model`` and return keyword batches, capped at ``num_samples`` samples in total.
    ``mmap``: memory-map ``.npy`` and ``.pt`` files (a torch.distributed rank reads only its own batches)."""
    path = Path(path)
    if not path.exists():
        raise DataError(f"data {path} does not exist")
    names, _, _ = forward_parameters(model)
    if path.is_dir():
        files = sorted(p for p in path.iterdir() if p.suffix.lower() in _SUFFIXES)
        if not files:
            raise DataError(f"data directory {path} has no .npz, .npy or .pt files")
        batches = []
        for f in files:
            bs, _ = _read(f, names, mmap)
            batches += bs
        whole = False
    else:
        batches, whole = _read(path, names, mmap)
    if whole and batch_size:
        batches = [s for b in batches for s in _split(b, batch_size, str(path))]
    batches = cap_samples(batches, num_samples)
    if not batches or all(_count(b) == 0 for b in batches):
        raise DataError(f"data {path} holds no samples")
    for b in batches:
        check_names(b, model, str(path))
    return batches


def _count(batch: Batch) -> int:
    return batch_axes.batch_size(batch)


def cap_samples(batches: list[Batch], num_samples: int | None) -> list[Batch]:
    if num_samples is None:
        return batches
    if num_samples <= 0:
        raise DataError(f"--num-samples must be positive, got {num_samples}")
    out, seen = [], 0
    for b in batches:
        if seen >= num_samples:
            break
        n = _count(b)
        take = min(n, num_samples - seen)
        out.append(batch_axes.take(b, 0, take, where=f"--num-samples {num_samples}") if take < n else b)
        seen += take
    return out


def num_samples(batches: list[Batch]) -> int:
    return sum(_count(b) for b in batches)


def describe(batch: Batch) -> str:
    """``x: float32[32, 1, 8, 8], mask: int64[32, 9]`` for error messages."""
    return ", ".join(f"{k}: {str(v.dtype).replace('torch.', '')}{list(v.shape)}" for k, v in batch.items())


def to_device(batch: Batch, device: torch.device) -> Batch:
    return {k: v.to(device, non_blocking=True) for k, v in batch.items()}


def named_outputs(out) -> list[tuple[str, torch.Tensor]]:
    """The tensors of a model's output in the order the exporters write them (tuples, lists and dicts
    flattened depth first, in order; ``None`` and other non-tensor values left out, as the exporters leave
    them out), each with its graph output name: the dict key, a namedtuple's field name, ``output_<i>`` for
    position ``i`` of another tuple, joined with ``.`` where nested (``reg.0``); a single tensor is
    ``output_0``."""
    found: list[tuple[str, torch.Tensor]] = []

    def walk(value, name: str) -> None:
        if isinstance(value, torch.Tensor):
            found.append((name or "output_0", value))
        elif isinstance(value, dict):
            for k, v in value.items():
                walk(v, f"{name}.{k}" if name else str(k))
        elif isinstance(value, tuple) and isinstance(getattr(type(value), "_fields", None), tuple):
            for field, v in zip(type(value)._fields, value):  # a namedtuple: its field names
                walk(v, f"{name}.{field}" if name else field)
        elif isinstance(value, (tuple, list)):
            for i, v in enumerate(value):
                walk(v, f"{name}.{i}" if name else f"output_{i}")
        elif _is_dataclass_value(value):  # as the dict of its fields (plain_outputs, for the exporters)
            walk(plain_outputs(value), name)

    walk(out, "")
    return found


def _is_dataclass_value(value) -> bool:
    return dataclasses.is_dataclass(value) and not isinstance(value, type)


def plain_outputs(out):
    """``out`` as the exporters can trace it (tensors, None, tuples, lists and dicts of str keys): a dataclass
    instance (a model's own output class) replaced by the dict of its fields that are not None, a value that
    is no tensor (an int, a string: no graph output, as :func:`named_outputs` leaves it out) by None in a
    tuple or list and left out of a dict, a dict key by its ``str``, recursively. ``out`` itself where nothing
    needs replacing."""
    if not needs_plain(out):
        return out
    if isinstance(out, dict):
        kept = {str(k): plain_outputs(v) for k, v in out.items()}
        return {k: v for k, v in kept.items() if v is not None}
    if isinstance(out, (tuple, list)):
        values = [plain_outputs(v) for v in out]
        return type(out)(values) if type(out) in (tuple, list) else type(out)(*values)  # a namedtuple
    if _is_dataclass_value(out):
        fields = ((f.name, getattr(out, f.name)) for f in dataclasses.fields(out))
        return {k: plain_outputs(v) for k, v in fields if v is not None}
    return None  # a value that is no tensor


def distinct_outputs(out):
    """``out`` (as :func:`plain_outputs` leaves it) with every tensor it holds a second time replaced by a
    copy (``clone``: an ``Identity`` in the graph), so that no graph value is two outputs; ``out`` itself
    where no tensor repeats."""
    seen: set[int] = set()

    def walk(value):
        if isinstance(value, torch.Tensor):
            if id(value) in seen:
                return value.clone()
            seen.add(id(value))
            return value
        if isinstance(value, dict):
            return {k: walk(v) for k, v in value.items()}
        if isinstance(value, (tuple, list)):
            values = [walk(v) for v in value]
            return type(value)(values) if type(value) in (tuple, list) else type(value)(*values)
        return value

    if not repeats_a_tensor(out):
        return out
    return walk(out)


def repeats_a_tensor(out) -> bool:
    """Whether one tensor appears twice among a model's outputs (:func:`named_outputs`)."""
    ids = [id(t) for _, t in named_outputs(out)]
    return len(ids) != len(set(ids))


def needs_plain(value) -> bool:
    """Whether :func:`plain_outputs` changes ``value``."""
    if value is None or isinstance(value, torch.Tensor):
        return False
    if isinstance(value, dict):
        return any(not isinstance(k, str) for k in value) or any(map(needs_plain, value.values()))
    if isinstance(value, (tuple, list)):
        return any(map(needs_plain, value))
    return True  # a dataclass, or a value that is no tensor


def flat_outputs(out) -> list[torch.Tensor]:
    """The tensors of a model's output in the exporters' order (:func:`named_outputs`)."""
    return [t for _, t in named_outputs(out)]


def output_arrays(out) -> list[np.ndarray]:
    """A model's output as numpy arrays (on the CPU), in the exporters' order: what an onnxruntime session's
    outputs are compared with."""
    return [t.detach().cpu().numpy() for t in flat_outputs(out)]


def run_model(model: nn.Module, batch: Batch, where: str = "batch"):
    """``model(**batch)`` with errors turned into a DataError that names the inputs and their shapes."""
    try:
        return call_forward(model, fresh(batch))
    except (RuntimeError, ValueError, TypeError, IndexError, AssertionError) as e:
        msg = first_line(e)
        raise DataError(f"forward({describe(batch)}) failed on {where}: {msg}") from None


@dataclass
class DataOptions:
    """How text files and image folders become tensors (tensor files ignore these).

    ``model_folder``: a Hugging Face model folder (default tokenizer, ``preprocessor_config.json``);
    ``stored``: the preprocessing a calibrated checkpoint recorded (verify's defaults).
    """

    tokenizer: str | Path | None = None
    max_length: int | None = None
    image_size: str | None = None
    mean: str | None = None
    std: str | None = None
    model_folder: str | Path | None = None
    stored: dict[str, Any] | None = None
    batch_size_given: bool = False  # --batch-size was given (it re-batches whole arrays, not batch files)
    min_length: int | None = None  # the fewest tokens per example the reader needs (verify of a decode graph)


DEFAULT_MAX_LENGTH = defaults.MAX_LENGTH


def load_data(
    path: str | Path,
    model: nn.Module,
    batch_size: int | None = defaults.BATCH_SIZE,
    num_samples: int | None = None,
    options: DataOptions | None = None,
    shard: tuple[int, int] | None = None,
) -> tuple[list[Batch], dict[str, Any] | None]:
    """:func:`load_batches`, plus text files (``.txt``/``.jsonl``) and folders of JPEG/PNG images.

    Returns ``(batches, preprocessing)``: ``preprocessing`` is plain data saying how text or images became
    tensors (``None`` for tensor files); a calibrated checkpoint stores it so verify repeats it.
    ``shard=(rank, world_size)`` keeps batches ``rank, rank + world_size, ...`` (a torch.distributed rank's
    share, :mod:`quantcli.inputs.shard`); images of the other batches are not decoded.
    """
    opts = options or DataOptions()
    path = Path(path)
    if not path.exists():
        raise DataError(f"data {path} does not exist")
    kind = _data_kind(path)
    _refuse_unused_options(path, kind, opts)
    batch_size = batch_size or defaults.BATCH_SIZE
    names, _, var_kw = forward_parameters(model)
    if kind == "text":
        if any(c.__name__.endswith("ForMultipleChoice") for c in type(model).__mro__):
            # its forward reads (batch, choices, sequence); a text file gives one sequence per line
            name = type(model).__name__.removesuffix("Deployed")
            raise DataError(
                f"{name} takes (batch, choices, sequence) token ids, and {path} gives one "
                "sequence per line: tokenize each example's choices yourself and save input_ids and "
                "attention_mask (and token_type_ids) as (batch, choices, sequence) arrays in an .npz"
            )
        batches, prep = _text_data(
            path, names, var_kw, batch_size, num_samples, opts, shard, model_positions(model)
        )
    elif kind == "images":
        batches, prep = _image_data(path, model, names, batch_size, num_samples, opts, shard)
    else:
        batches = load_batches(path, model, batch_size, num_samples, mmap=shard is not None)
        return (batches if shard is None else batches[shard[0] :: shard[1]]), None
    # forward's order: the torchscript exporter names graph inputs in the batch's key order but passes them
    # positionally in forward's order (a tokenizer returns token_type_ids before attention_mask)
    batches = [
        {**{k: b[k] for k in names if k in b}, **{k: v for k, v in b.items() if k not in names}}
        for b in batches
    ]
    for b in batches:
        check_names(b, model, str(path))
    return batches, prep


def given_options(opts: DataOptions) -> dict[str, list[str]]:
    """The preprocessing flags given, by the kind of data they apply to (``text``, ``images``)."""
    given = {
        "text": [("--tokenizer", opts.tokenizer), ("--max-length", opts.max_length)],
        "images": [("--image-size", opts.image_size), ("--mean", opts.mean), ("--std", opts.std)],
    }
    return {k: [flag for flag, v in flags if v is not None] for k, flags in given.items()}


def _data_kind(path: Path) -> str:
    """``text`` (a .txt/.jsonl file), ``images`` (a folder without tensor files) or ``tensors``."""
    from quantcli.inputs.text_data import TEXT_SUFFIXES

    if path.is_file() and path.suffix.lower() in TEXT_SUFFIXES:
        return "text"
    if path.is_dir() and not any(p.suffix.lower() in _SUFFIXES for p in path.iterdir()):
        return "images"
    return "tensors"


def unused_options_error(unused: list[str], applies_to: str, why: str, instead: str = "") -> DataError:
    """The refusal of preprocessing flags that would do nothing: ``--mean applies to image data; {why}: leave
    it out{instead}``."""
    them = "it" if len(unused) == 1 else "them"
    return DataError(f"{flags_apply(unused)} to {applies_to}; {why}: leave {them} out{instead}")


def refuse_without_data(opts: DataOptions, batch_size_given: bool, why: str) -> None:
    """Preprocessing flags and ``--batch-size`` where no ``--data`` is given (``why``: what is used instead,
    batches that are tensors already): a setting that would do nothing is refused, not dropped in silence."""
    unused = [flag for flags in given_options(opts).values() for flag in flags]
    if unused:
        raise unused_options_error(
            unused, "a text file or image folder given with --data", why, ", or pass --data"
        )
    if batch_size_given:
        raise unused_options_error(
            ["--batch-size"], "whole arrays given with --data (re-batched)", why, ", or pass --data"
        )


def _refuse_unused_options(path: Path, kind: str, opts: DataOptions) -> None:
    """Text options for image or tensor data, image options for text or tensor data (``kind``, of
    :func:`_data_kind`): a setting that would do nothing is refused, not dropped in silence."""
    unused = [flag for k, flags in given_options(opts).items() if k != kind for flag in flags]
    if unused:
        what = {
            "text": "a text file",
            "images": "a folder of images",
            "tensors": "tensor data (.npy/.npz/.pt)",
        }
        applies = "text" if unused[0] in ("--tokenizer", "--max-length") else "image"
        raise unused_options_error(unused, f"{applies} data", f"{path} is {what[kind]}")
    refuse_rebatching(path, kind, opts)


def refuse_rebatching(path: Path, kind: str, opts: DataOptions) -> None:
    """``--batch-size`` for a directory of batch files, which are used one batch per file as they are:
    refused, not dropped in silence (the summary said "64 samples in 4 batches" of 16 where 8 were asked
    for)."""
    if opts.batch_size_given and kind == "tensors" and path.is_dir():
        raise unused_options_error(
            ["--batch-size"],
            "whole arrays (an .npz/.npy/.pt file, re-batched)",
            f"{path} is a directory of batch files, used one batch per file",
            " (or write the files with that many samples each)",
        )


def model_positions(model: nn.Module) -> int | None:
    """The tokens a Hugging Face model's config gives it positions for (``max_position_embeddings``, GPT-2's
    ``n_positions``, less the rows RoBERTa-style embeddings skip), else None: a learned position embedding has
    no row beyond them."""
    cfg = getattr(model, "config", None)
    for key in ("max_position_embeddings", "n_positions"):
        v = getattr(cfg, key, None) if cfg is not None else None
        if isinstance(v, int) and v > 0:
            return v - _position_offset(model)
    return None


def _position_offset(model: nn.Module) -> int:
    """Rows of the position embedding no token reaches: RoBERTa-style embeddings (XLM-R, CamemBERT,
    Longformer, ...) number positions from ``padding_idx + 1`` (``create_position_ids_from_input_ids``), so
    514 positions with padding index 1 hold 512 tokens."""
    for m in model.modules():
        table = getattr(m, "position_embeddings", None)
        pad = getattr(m, "padding_idx", None)
        if (
            isinstance(table, nn.Embedding)
            and isinstance(pad, int)
            and hasattr(m, "create_position_ids_from_input_ids")
        ):
            return pad + 1
    return 0


def _text_data(
    path: Path,
    names: list[str],
    var_kw: bool,
    batch_size: int,
    num_samples: int | None,
    opts: DataOptions,
    shard: tuple[int, int] | None,
    positions: int | None = None,
) -> tuple[list[Batch], dict[str, Any]]:
    """A text file tokenized (the tokenizer stored in a checkpoint, unless ``--tokenizer`` names one):
    batches, and the preprocessing to store (tokenizer files, max length). ``positions``: the model's own
    limit (:func:`model_positions`), which the default length keeps within and ``--max-length`` may not
    pass."""
    from quantcli.inputs.text_data import load_tokenizer, read_texts, text_batches, tokenizer_files

    stored = opts.stored or {}
    texts = read_texts(path)
    if num_samples is not None:
        texts = texts[: _positive_samples(num_samples)]
    max_length = opts.max_length  # 0 is refused below, not taken as "not given"
    if max_length is None:
        kept_length = stored.get("max_length") if stored.get("kind") == "text" else None
        max_length = kept_length or min(DEFAULT_MAX_LENGTH, positions or DEFAULT_MAX_LENGTH)
        if opts.min_length is not None and max_length < opts.min_length:
            max_length = min(opts.min_length, positions or opts.min_length)
    elif positions is not None and max_length > positions:
        raise DataError(
            f"--max-length {max_length} is beyond the model's {positions} positions (its config); pass "
            f"--max-length {positions} or less"
        )
    folder = opts.tokenizer or opts.model_folder
    kept = stored.get("tokenizer_files") if stored.get("kind") == "text" else None
    if opts.tokenizer is None and kept:
        tok = load_tokenizer(None, {k: v.numpy().tobytes() for k, v in kept.items()})
        source, files = stored.get("tokenizer", "stored in the checkpoint"), kept
    else:
        tok = load_tokenizer(folder)
        source = str(Path(folder).resolve())  # absolute: generate finds it from any directory
        files = {
            k: torch.frombuffer(bytearray(v), dtype=torch.uint8).clone()
            for k, v in tokenizer_files(folder).items()
        }
    batches = text_batches(texts, tok, max_length, batch_size, names, var_kw)
    if shard is not None:
        batches = batches[shard[0] :: shard[1]]
    return batches, {"kind": "text", "tokenizer": source, "max_length": max_length, "tokenizer_files": files}


def _image_data(
    path: Path,
    model: nn.Module,
    names: list[str],
    batch_size: int,
    num_samples: int | None,
    opts: DataOptions,
    shard: tuple[int, int] | None,
) -> tuple[list[Batch], dict[str, Any]]:
    """A folder of images decoded and normalised (the checkpoint's settings unless options override them):
    batches, and the preprocessing to store (size, mean, std)."""
    from quantcli.inputs.image_data import image_batches, image_settings, parse_floats, parse_size

    stored = opts.stored or {}
    if not names:
        raise DataError(f"{path}: {_UNNAMED}")
    settings = image_settings(
        opts.model_folder,
        parse_size(opts.image_size),
        parse_floats(opts.mean, "--mean"),
        parse_floats(opts.std, "--std"),
        stored if stored.get("kind") == "image" else None,
    )
    if num_samples is not None:
        _positive_samples(num_samples)
    batches = image_batches(path, model, names[0], settings, batch_size, num_samples, shard)
    prep = settings.to_plain()
    prep["summary"] = settings.describe()
    return batches, prep


def _positive_samples(n: int) -> int:
    if n <= 0:
        raise DataError(f"--num-samples must be positive, got {n}")
    return n


def describe_preprocessing(prep: dict[str, Any] | None) -> str | None:
    """One line for summaries: which tokenizer / image settings were used."""
    if not prep:
        return None
    if prep["kind"] == "text":
        return f"tokenized with {prep['tokenizer']} (max length {prep['max_length']}, padded per batch)"
    return prep.get("summary")
