"""Text calibration / verification data: ``.txt`` (one example per line) or ``.jsonl`` (a ``text`` field per
line), tokenized with a Hugging Face tokenizer into the integer inputs ``forward`` takes.

Blank lines are skipped. Each batch is padded to its own longest example (at most ``max_length`` tokens), so
sequence lengths differ between batches as they would in deployment; a tokenizer without a padding token (a
causal LM's) pads with its end-of-sequence token. The tokenizer comes from a folder (``--tokenizer``, else the
model folder) or from the files a calibrated checkpoint stored, loaded with ``local_files_only`` and without
``trust_remote_code``.
"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path
from typing import Any

import torch

from quantcli.errors import DataError, first_line

TEXT_SUFFIXES = (".txt", ".jsonl")
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "vocab.txt",
    "vocab.json",
    "merges.txt",
    "spiece.model",
    "sentencepiece.bpe.model",
    "tokenizer.model",
    "config.json",
)
_TOKENIZER_CORE = (
    "tokenizer.json",
    "vocab.txt",
    "vocab.json",
    "spiece.model",
    "sentencepiece.bpe.model",
    "tokenizer.model",
)
MAX_STORED_BYTES = 64 * 2**20


def _decode(path: Path) -> str:
    raw = path.read_bytes()
    try:
        return raw.decode("utf-8-sig")
    except UnicodeDecodeError as e:
        line = raw[: e.start].count(b"\n") + 1
        raise DataError(
            f"{path} is not UTF-8 text (byte 0x{raw[e.start]:02x} on line {line}); save it as UTF-8"
        ) from None


def read_texts(path: str | Path) -> list[str]:
    """The examples of a ``.txt`` or ``.jsonl`` file, in order."""
    path = Path(path)
    text = _decode(path)
    if path.suffix.lower() == ".txt":
        texts = [ln for ln in text.splitlines() if ln.strip()]
    else:
        texts = []
        for i, ln in enumerate(text.splitlines(), 1):
            if not ln.strip():
                continue
            try:
                obj = json.loads(ln)
            except json.JSONDecodeError as e:
                raise DataError(f"{path} line {i} is not JSON: {e.msg}") from None
            if not isinstance(obj, dict) or not isinstance(obj.get("text"), str):
                raise DataError(f'{path} line {i} has no "text" string field')
            texts.append(obj["text"])
    if not texts:
        raise DataError(f"{path} holds no text (it is empty or blank)")
    return texts


def tokenizer_files(folder: str | Path) -> dict[str, bytes]:
    """The tokenizer's files in ``folder`` (what a checkpoint stores so verify works after the folder is
    gone)."""
    folder = Path(folder)
    files = {n: (folder / n).read_bytes() for n in TOKENIZER_FILES if (folder / n).is_file()}
    return files if sum(map(len, files.values())) <= MAX_STORED_BYTES else {}


def _transformers():
    from quantcli.inputs.hf_model import transformers_module

    return transformers_module()


def load_tokenizer(folder: str | Path | None = None, stored: dict[str, bytes] | None = None):
    """A tokenizer from ``folder``, else from ``stored`` files. Raises DataError when there is none."""
    if folder is not None:
        folder = Path(folder)
        if not folder.is_dir():
            raise DataError(f"tokenizer folder {folder} does not exist")
        if not any((folder / n).is_file() for n in _TOKENIZER_CORE):
            raise DataError(
                f"{folder} has no tokenizer ({', '.join(_TOKENIZER_CORE)}); pass --tokenizer "
                f"FOLDER "
                "with the model's tokenizer files"
            )
        return _from_folder(folder)
    if stored:
        with tempfile.TemporaryDirectory(prefix="quantcli-tokenizer-") as tmp:
            for name, data in stored.items():
                (Path(tmp) / Path(name).name).write_bytes(data)
            return _from_folder(Path(tmp))
    raise DataError(
        "text data needs a tokenizer: pass --tokenizer FOLDER (a folder with tokenizer.json or vocab.txt)"
    )


def _from_folder(folder: Path):
    tf = _transformers()
    try:
        return tf.AutoTokenizer.from_pretrained(str(folder), local_files_only=True, trust_remote_code=False)
    except Exception as e:
        raise DataError(f"cannot load the tokenizer in {folder}: {first_line(e, 200)}") from None


def text_batches(
    texts: list[str], tokenizer: Any, max_length: int, batch_size: int, accepted: list[str], var_kw: bool
) -> list[dict[str, torch.Tensor]]:
    """Tokenize ``batch_size`` texts at a time, padded to the batch's longest (at most ``max_length`` tokens).

    Keeps the tokenizer outputs ``forward`` accepts (``accepted``; all of them when it takes ``**kwargs``).
    """
    if max_length <= 0:
        raise DataError(f"--max-length must be positive, got {max_length}")
    if batch_size > 1 and len(texts) > 1:
        _pad_with_eos(tokenizer)
    batches = []
    # one text a batch needs no padding, and a tokenizer without a padding token refuses to be asked for it
    pad = getattr(tokenizer, "pad_token", None) is not None
    for i in range(0, len(texts), batch_size):
        try:
            enc = tokenizer(
                texts[i : i + batch_size],
                padding=pad,
                truncation=True,
                max_length=max_length,
                return_tensors="pt",
            )
        except Exception as e:
            raise DataError(f"the tokenizer failed: {first_line(e, 200)}") from None
        batch = {
            k: v.to(torch.int64)
            for k, v in enc.items()
            if isinstance(v, torch.Tensor) and (var_kw or k in accepted)
        }
        if "input_ids" not in batch:
            raise DataError(f"text data gives input_ids, but forward takes ({', '.join(accepted)})")
        batches.append(batch)
    return batches


def _pad_with_eos(tokenizer: Any) -> None:
    """Causal-LM tokenizers (GPT-2's, Llama's) have no padding token: pad with the end-of-sequence token, as
    transformers' own generation does. The padded positions are masked out by ``attention_mask``."""
    if getattr(tokenizer, "pad_token", None) is not None:
        return
    if getattr(tokenizer, "eos_token", None) is None:
        raise DataError(
            "the tokenizer has no padding token (nor an end-of-sequence token to pad with), so texts cannot "
            "be batched: pass --batch-size 1, or set pad_token in its tokenizer_config.json"
        )
    tokenizer.pad_token = tokenizer.eos_token
