"""MODEL as a Hugging Face model folder (``config.json`` + ``model.safetensors`` / ``pytorch_model.bin``),
offline.

The class ``architectures`` names (a task head) is built from the installed ``transformers``, else the base
model (``AutoModel``); weights are read by ``from_pretrained`` with ``local_files_only`` (safetensors, or
``.bin`` read with ``weights_only=True``, which quantcli checks itself first). No code from the folder ever
runs (``trust_remote_code`` stays off). The config is stored in the calibrated checkpoint, so export and
verify rebuild the same class from the installed ``transformers`` after the folder is gone; that is not
checkpoint code.

The module quantcli calibrates is the transformers model itself with a ``forward`` that takes the tensor
inputs (``input_ids``, ``attention_mask``, ``token_type_ids`` where the model takes it and is not a causal
LM, which generates without them; or ``pixel_values``)
and returns what a user deploys: every ``*logits`` output of a task head, else its ``*_embeds`` (a projection
head: ``CLIPTextModelWithProjection``'s ``text_embeds``), else ``last_hidden_state``, or with
``pooling="mean"`` its mean over the (unmasked) tokens as ``embeddings``. A causal LM (``GPT2LMHeadModel``,
``LlamaForCausalLM``, ``Qwen2ForCausalLM``, ...) gives its ``logits`` for every position of the sequence,
computed with ``use_cache=False``: the graph is a prefill over the full sequence, with no KV cache inputs or
outputs.
"""

from __future__ import annotations

import inspect
import json
from pathlib import Path
from typing import Any

import torch
from torch import nn

from quantcli.errors import MissingExtraError, ModelLoadError, first_line

WEIGHT_FILES = (
    "model.safetensors",
    "model.safetensors.index.json",
    "pytorch_model.bin",
    "pytorch_model.bin.index.json",
)
POOLINGS = ("none", "mean")


def transformers_module():
    try:
        import transformers
    except ImportError:
        raise MissingExtraError(
            "Hugging Face model folders need transformers: pip install 'quantcli[hf]'"
        ) from None
    transformers.utils.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    return transformers


def is_hf_folder(path: Path) -> bool:
    return (path / "config.json").is_file()


def _read_config(folder: Path) -> dict[str, Any]:
    if not folder.is_dir() or not is_hf_folder(folder):
        raise ModelLoadError(
            f"MODEL folder {folder} is not a Hugging Face model folder (no config.json); "
            "save one with model.save_pretrained(folder)"
        )
    try:
        cfg = json.loads((folder / "config.json").read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ModelLoadError(f"{folder}/config.json is not valid JSON: {first_line(e)}") from None
    if not isinstance(cfg, dict) or "model_type" not in cfg:
        raise ModelLoadError(f"{folder}/config.json has no model_type; it is not a transformers model config")
    if cfg.get("auto_map"):
        raise ModelLoadError(
            f"{folder}/config.json asks for custom model code (auto_map); quantcli builds "
            f"only "
            "classes of the installed transformers and never runs code from a model folder"
        )
    return cfg


def _config_object(cfg: dict[str, Any], where: str):
    tf = transformers_module()
    try:
        return tf.AutoConfig.for_model(**cfg)
    except (ValueError, KeyError) as e:
        raise ModelLoadError(
            f"{where}: model_type {cfg.get('model_type')!r} is unknown to transformers "
            f"{tf.__version__} ({first_line(e, 120)}); upgrade transformers"
        ) from None


def _family_class(model_type, name: str):
    """Class ``name`` from transformers' own modeling module of ``model_type``
    (``transformers.models.whisper.modeling_whisper``), or None."""
    import importlib

    if not isinstance(model_type, str) or not model_type.replace("_", "").isalnum():
        return None
    family = model_type.replace("-", "_")
    try:
        module = importlib.import_module(f"transformers.models.{family}.modeling_{family}")
    except Exception:
        return None
    return getattr(module, name, None)


def _model_class(cfg: dict[str, Any], config, where: str):
    tf = transformers_module()
    archs = cfg.get("architectures") or []
    if archs:
        cls = getattr(tf, archs[0], None)
        if cls is None:  # a class transformers has but does not export at its top level (WhisperEncoder)
            cls = _family_class(cfg.get("model_type"), archs[0])
        if cls is None or not isinstance(cls, type) or not issubclass(cls, nn.Module):
            raise ModelLoadError(
                f"{where}: config names class {archs[0]!r}, which transformers "
                f"{tf.__version__} "
                "does not have; upgrade transformers (quantcli does not run code from "
                "model folders)"
            )
        return cls
    try:
        return tf.MODEL_MAPPING[type(config)]
    except KeyError:
        raise ModelLoadError(
            f"{where}: transformers {tf.__version__} has no base model for model_type "
            f"{cfg.get('model_type')!r}"
        ) from None


def _is_base(cls, config) -> bool:
    tf = transformers_module()
    try:
        return cls is tf.MODEL_MAPPING[type(config)]
    except KeyError:
        return False


def is_causal_lm_class(cls) -> bool:
    """A transformers causal LM class (``LlamaForCausalLM``, ``GPT2LMHeadModel``, ...), by its name."""
    return cls.__name__.endswith(("ForCausalLM", "LMHeadModel"))


def _inputs(cls) -> list[str]:
    params = inspect.signature(cls.forward).parameters
    if "decoder_input_ids" in params:
        # BART/T5/Marian/...: called with input_ids alone, BART feeds its decoder the shifted input and T5
        # raises; neither is the model a user deploys (a seq2seq model generates from decoder inputs)
        raise ModelLoadError(
            f"{cls.__name__} is an encoder-decoder (seq2seq) model, which quantcli does not export; it "
            "handles encoder-only and decoder-only (causal LM) text models and image models"
        )
    if "input_ids" in params and "pixel_values" in params:
        # CLIPModel, a vision-language model: the text wrapper dropped its images, and its forward failed on
        # "'NoneType' object has no attribute 'shape'", blaming the model
        raise ModelLoadError(
            f"{cls.__name__} takes text and images together (input_ids and pixel_values); quantcli reads "
            "Hugging Face folders of text or image models: build this one in a model file (model.py:make "
            f"returning {cls.__name__}.from_pretrained(FOLDER)) and pass both inputs in an .npz"
        )
    if "input_ids" in params:
        # a causal LM generates without token types (its decode graph takes none): a tokenizer that emits
        # them (a BERT tokenizer beside GPT-2) must not calibrate on an input the graph never gets
        types = "token_type_ids" in params and not is_causal_lm_class(cls)
        return ["input_ids", "attention_mask"] + (["token_type_ids"] if types else [])
    if "pixel_values" in params:
        return ["pixel_values"]
    raise ModelLoadError(
        f"{cls.__name__} takes neither input_ids nor pixel_values; quantcli reads Hugging Face folders of "
        "text and image models: build this one in a model file (model.py:make returning "
        f"{cls.__name__}.from_pretrained(FOLDER)) and pass its inputs as an .npz keyed by their names"
    )


def hf_spec(folder: Path, pooling: str = "none"):
    """A ModelSpec for a Hugging Face folder: config, class name, inputs and outputs, all plain data."""
    from quantcli.inputs.model_spec import ModelSpec

    if pooling not in POOLINGS:
        raise ModelLoadError(f"--pooling must be one of {', '.join(POOLINGS)}, got {pooling!r}")
    cfg = _read_config(folder)
    config = _config_object(cfg, str(folder))
    cls = _model_class(cfg, config, str(folder))
    if pooling != "none" and not _is_base(cls, config):
        raise ModelLoadError(
            f"--pooling {pooling} pools a base model's last_hidden_state, but {folder} is "
            f"{cls.__name__}, a task head whose logits are the output"
        )
    if not any((folder / f).is_file() for f in WEIGHT_FILES):
        raise ModelLoadError(f"{folder} has config.json but no weights ({', '.join(WEIGHT_FILES)})")
    extra = {
        "config": json.dumps(cfg),
        "architecture": cls.__name__,
        "pooling": pooling,
        "inputs": _inputs(cls),
        "task_head": not _is_base(cls, config),
    }
    eos = _generation_eos(folder)
    if eos:
        extra["generation_eos"] = eos
    return ModelSpec("hf", str(folder), str(folder.resolve()), None, extra)


def _generation_eos(folder: Path) -> list[int]:
    """The end-of-sequence ids of the folder's ``generation_config.json`` (Llama-3-Instruct's end of turn
    beside config.json's end of text), which transformers' ``generate`` stops at; [] without one."""
    path = folder / "generation_config.json"
    try:
        ids = json.loads(path.read_text()).get("eos_token_id") if path.is_file() else None
    except (OSError, ValueError, AttributeError):
        return []  # unreadable: generation stops at config.json's ids, as before
    ids = ids if isinstance(ids, list) else [ids]
    return [int(i) for i in ids if isinstance(i, int) and not isinstance(i, bool)]


def _check_bin_weights(folder: Path) -> None:
    """Every ``.bin`` weight file must read with ``weights_only=True`` (plain tensors, no code)."""
    if (folder / "model.safetensors").is_file() or (folder / "model.safetensors.index.json").is_file():
        return
    index = folder / "pytorch_model.bin.index.json"
    files = (
        [folder / f for f in sorted(set(json.loads(index.read_text())["weight_map"].values()))]
        if index.is_file()
        else [folder / "pytorch_model.bin"]
    )
    for f in files:
        try:
            torch.load(f, map_location="cpu", weights_only=True, mmap=True)
        except Exception as e:
            raise ModelLoadError(
                f"{f} does not read as plain weights (weights_only=True): {first_line(e, 160)}"
            ) from None


class _Outputs:
    """Mixin placed in front of the transformers class: tensor inputs in, the deployed outputs out."""

    quantcli_pooling = "none"
    quantcli_task_head = True
    #: ``{"use_cache": False}`` where forward takes ``use_cache``: a decoder LM runs (and exports) as a
    # prefill over : the whole sequence, without building a KV cache
    quantcli_no_cache: dict = {}

    def _quantcli_outputs(self, out, attention_mask):
        if self.quantcli_task_head:
            logits = {k: v for k, v in out.items() if k.endswith("logits") and isinstance(v, torch.Tensor)}
            if logits:
                return logits
            # a projection head's embeddings (CLIPTextModelWithProjection's text_embeds): what it is for
            embeds = {k: v for k, v in out.items() if k.endswith("_embeds") and isinstance(v, torch.Tensor)}
            if embeds:
                return embeds
        h = out["last_hidden_state"] if "last_hidden_state" in out else out[0]
        if self.quantcli_pooling == "mean":
            if h.dim() == 4:  # (batch, channels, height, width): pool over space
                return {"embeddings": h.mean(dim=(2, 3))}
            if attention_mask is None:
                return {"embeddings": h.mean(dim=1)}
            m = attention_mask.unsqueeze(-1).to(h.dtype)
            return {"embeddings": (h * m).sum(dim=1) / m.sum(dim=1).clamp(min=1.0)}
        return {"last_hidden_state": h}


class _TextWithTypes(_Outputs):
    def forward(self, input_ids, attention_mask=None, token_type_ids=None):
        out = super().forward(
            input_ids=input_ids,
            attention_mask=attention_mask,
            token_type_ids=token_type_ids,
            return_dict=True,
            **self.quantcli_no_cache,
        )
        return self._quantcli_outputs(out, attention_mask)


class _Text(_Outputs):
    def forward(self, input_ids, attention_mask=None):
        out = super().forward(
            input_ids=input_ids, attention_mask=attention_mask, return_dict=True, **self.quantcli_no_cache
        )
        return self._quantcli_outputs(out, attention_mask)


class _Image(_Outputs):
    def forward(self, pixel_values):
        out = super().forward(pixel_values=pixel_values, return_dict=True)
        return self._quantcli_outputs(out, None)


_WRAPPED: dict[tuple[type, type], type] = {}


def _deployable(model: nn.Module, extra: dict[str, Any]) -> nn.Module:
    inputs = extra["inputs"]
    mixin = _Image if inputs == ["pixel_values"] else _TextWithTypes if "token_type_ids" in inputs else _Text
    cls = type(model)
    key = (mixin, cls)
    if key not in _WRAPPED:
        _WRAPPED[key] = type(f"{cls.__name__}Deployed", (mixin, cls), {"__module__": __name__})
    model.__class__ = _WRAPPED[key]  # same parameters and names; only forward's signature and outputs change
    model.quantcli_pooling = extra.get("pooling", "none")
    model.quantcli_task_head = bool(extra.get("task_head", True))
    model.quantcli_generation_eos = tuple(extra.get("generation_eos") or ())
    if "use_cache" in inspect.signature(cls.forward).parameters:
        model.quantcli_no_cache = {"use_cache": False}
    return model


def load_hf_folder(spec) -> nn.Module:
    """The model of a Hugging Face folder with its weights (calibration time: the folder is there)."""
    folder = Path(spec.path)
    extra = spec.extra
    if not folder.is_dir():
        raise ModelLoadError(f"MODEL folder {folder} does not exist")
    _check_bin_weights(folder)
    cls = getattr(transformers_module(), extra["architecture"])
    try:
        model, info = cls.from_pretrained(
            str(folder),
            local_files_only=True,
            trust_remote_code=False,
            attn_implementation="eager",
            output_loading_info=True,
        )
    except Exception as e:
        raise ModelLoadError(f"cannot load {folder} as {cls.__name__}: {first_line(e, 200)}") from None
    missing = sorted(info.get("missing_keys") or [])
    mismatched = sorted(str(k) for k in info.get("mismatched_keys") or [])
    if missing or mismatched:
        what = f"missing {', '.join(missing[:5])}" if missing else f"mis-shaped {', '.join(mismatched[:5])}"
        raise ModelLoadError(
            f"the weights in {folder} do not fill {cls.__name__} ({what}); those would be random"
        )
    # a bf16/fp16 checkpoint is calibrated from exact fp32 copies
    return _deployable(model.float().eval(), extra)


def build_hf_model(spec, from_folder: bool = False) -> nn.Module:
    """From the folder (calibration) or, without weights, from the stored config (the checkpoint has them)."""
    if from_folder:
        return load_hf_folder(spec)
    extra = spec.extra
    cfg = json.loads(extra["config"])
    config = _config_object(cfg, spec.spec)
    cls = _model_class(cfg, config, spec.spec)
    try:
        model = cls._from_config(config, attn_implementation="eager")
    except Exception as e:
        raise ModelLoadError(
            f"cannot build {cls.__name__} from the stored config: {first_line(e, 200)}"
        ) from None
    return _deployable(model.float().eval(), extra)
