"""Text <-> token ids for a decode graph: the tokenizer of the model it was exported from, or ``--tokenizer``.

The graph's metadata names the model (``quantcli.model``): a sample model brings its own (``tiny_llama``: one
token per byte of UTF-8), a Hugging Face folder its tokenizer files, read with transformers' ``AutoTokenizer``
(offline; no code from the folder runs). ``--tokenizer FOLDER`` overrides both.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from quantcli.errors import DataError

BYTE_SAMPLES = ("tiny_llama", "tiny_lm")  # sample models whose tokens are the bytes of UTF-8 text


@dataclass
class TextCodec:
    """``encode(text) -> ids`` and ``decode(ids) -> text``, and where they come from."""

    name: str
    _encode: object
    _decode: object
    is_bytes: bool = False  # one token per byte of UTF-8 (ids 0..255)

    def encode(self, text: str) -> list[int]:
        return list(self._encode(text))

    def decode(self, ids: list[int]) -> str:
        return self._decode(list(ids))


def byte_codec(name: str = "bytes (UTF-8)") -> TextCodec:
    return TextCodec(
        name,
        lambda t: t.encode("utf-8"),
        lambda ids: bytes(ids).decode("utf-8", errors="replace"),
        is_bytes=True,
    )


def hf_codec(folder: Path) -> TextCodec:
    from quantcli.inputs.hf_model import transformers_module

    tf = transformers_module()
    try:
        tok = tf.AutoTokenizer.from_pretrained(str(folder), local_files_only=True, trust_remote_code=False)
    except Exception as e:  # transformers raises OSError/ValueError/... for a folder without tokenizer files
        raise DataError(f"no tokenizer in {folder} ({type(e).__name__}); pass --tokenizer FOLDER") from None
    return TextCodec(
        str(folder),
        # the special tokens the tokenizer adds (a BOS), as calibration's texts and transformers' generate do
        lambda t: tok(t)["input_ids"],
        lambda ids: tok.decode(ids, skip_special_tokens=False),
    )


def _metadata(onnx_path: Path) -> dict[str, str]:
    import onnx

    return {p.key: p.value for p in onnx.load(str(onnx_path), load_external_data=False).metadata_props}


def codec_for(onnx_path: Path, tokenizer: Path | None = None) -> TextCodec:
    """The tokenizer for ``onnx_path``: ``tokenizer`` (a folder with tokenizer files, or ``bytes``), else the
    graph's model's."""
    if tokenizer is not None:
        if str(tokenizer) == "bytes":
            return byte_codec()
        if not Path(tokenizer).is_dir():
            raise DataError(f"--tokenizer {tokenizer} is not a folder with tokenizer files (or 'bytes')")
        return hf_codec(Path(tokenizer))
    meta = _metadata(onnx_path)
    model = meta.get("quantcli.model")
    if model in BYTE_SAMPLES:
        return byte_codec(f"{model}: bytes (UTF-8)")
    # the absolute folder export recorded (calibration's tokenizer), found from any directory; else MODEL
    used = meta.get("quantcli.tokenizer")
    if used and Path(used).is_dir():
        return hf_codec(Path(used))
    if model and Path(model).is_dir():
        return hf_codec(Path(model))
    where = f"its model {model} is not on disk" if model else "it names no model"
    raise DataError(f"no tokenizer for {onnx_path}: {where}; pass --tokenizer FOLDER")
