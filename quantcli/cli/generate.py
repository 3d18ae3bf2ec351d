"""``quantcli generate``: text from a decode graph, driven by a plain onnxruntime loop (prefill, then one
token per step with the KV cache). The text goes to stdout as it is generated; the summary to stderr."""

from __future__ import annotations

import math
import sys
from pathlib import Path
from typing import Annotated, Optional

import typer

from quantcli.cli.guard import guarded
from quantcli.cli.options import JsonOpt
from quantcli.cli.output import err, key_value_table, print_json

#: tokens generated when --max-new-tokens is not given (fewer where the graph's context ends first)
DEFAULT_NEW_TOKENS = 64


def continuation(codec, prompt_ids: list[int], new_ids: list[int]) -> str:
    """The text ``new_ids`` add after the prompt: the decoded whole less the decoded prompt, as a tokenizer
    decodes a token differently at the start of a text (SentencePiece drops the first token's leading
    space: "France is" + "▁Paris" is "France is Paris", not "France isParis")."""
    head = codec.decode(prompt_ids)
    whole = codec.decode(list(prompt_ids) + list(new_ids))
    return whole[len(head) :] if whole.startswith(head) else codec.decode(new_ids)


class TextStream:
    """The text of a generation as it grows, in chunks that can be written as they come: each chunk is what
    the decoded continuation adds to what was written, held back while it ends in U+FFFD (a byte-level
    tokenizer's token that is part of a character: the character is complete only with a later token)."""

    def __init__(self, codec, prompt_ids: list[int]):
        self.codec, self.prompt_ids, self.written = codec, list(prompt_ids), ""

    def chunk(self, new_ids: list[int], final: bool = False) -> str:
        """What to write now for the continuation ``new_ids``: nothing where the text does not extend what
        was written (a tokenizer that decodes an earlier token differently once a later one follows)."""
        text = continuation(self.codec, self.prompt_ids, new_ids)
        if not final:
            text = text.rstrip("\ufffd")
        if not text.startswith(self.written):
            return ""
        out, self.written = text[len(self.written) :], text
        return out


@guarded
def generate(
    onnx_path: Annotated[Path, typer.Argument(help="A decode graph (quantcli export of a causal LM).")],
    prompt: Annotated[str, typer.Option("--prompt", help="The text to continue.")],
    max_new_tokens: Annotated[
        Optional[int],
        typer.Option(
            "--max-new-tokens",
            min=1,
            help="Tokens to generate at most (fewer at end of sequence). Default: 64, or what the graph's "
            "context leaves after the prompt.",
        ),
    ] = None,
    seed: Annotated[
        Optional[int],
        typer.Option(
            "--seed",
            min=0,
            help="Sample (softmax of the logits / --temperature, --top-k) with this seed; "
            "without it: greedy, the most likely token each step.",
        ),
    ] = None,
    temperature: Annotated[float, typer.Option("--temperature", min=0.0, help="Sampling temperature.")] = 1.0,
    top_k: Annotated[
        int, typer.Option("--top-k", min=0, help="Sample among the k most likely tokens (0: all).")
    ] = 0,
    threads: Annotated[
        Optional[int],
        typer.Option(
            "--threads",
            min=1,
            help="onnxruntime intra-op threads (default: onnxruntime's, one per physical core); 1 is often "
            "fastest for one sequence on a shared machine.",
        ),
    ] = None,
    tokenizer: Annotated[
        Optional[Path],
        typer.Option(
            "--tokenizer", help="Folder with tokenizer files, or 'bytes' (default: the graph's model's)."
        ),
    ] = None,
    as_json: JsonOpt = False,
) -> None:
    """Generate text with a decode graph in onnxruntime (CPU provider): greedy, or sampled with --seed."""
    from exporters.causal_lm.runner import DecodeSession, read_info
    from exporters.causal_lm.runner import generate as run_generation
    from exporters.graph import read_onnx
    from quantcli.errors import DataError, flags_apply
    from quantcli.verify.lm_text import codec_for

    if not math.isfinite(temperature):
        raise DataError(f"--temperature must be a finite number, got {temperature}")
    try:
        prompt.encode("utf-8")
    except UnicodeEncodeError:  # bytes that are no UTF-8 arrive as lone surrogates
        raise DataError("--prompt is not valid UTF-8 text; pass the prompt as UTF-8") from None
    if seed is None and (temperature != 1.0 or top_k):
        # greedy decoding ignores them: a setting that does nothing is refused, not dropped
        given = [f for f, on in (("--temperature", temperature != 1.0), ("--top-k", top_k)) if on]
        why = "pass --seed N to sample (without it, decoding is greedy)"
        raise DataError(f"{flags_apply(given, ' and ')} to sampling: {why}")
    # a missing, corrupt or truncated file (or external data) is a one-line error; the weights stay on disk
    read_onnx(onnx_path, weights=False)
    layout = read_info(onnx_path).layout  # not a decode graph: said before looking for its tokenizer
    codec = codec_for(onnx_path, tokenizer)
    ids = codec.encode(prompt)
    if not ids:
        raise DataError("--prompt is empty: give at least one token of text")
    vocab = layout.get("vocab_size")
    if vocab and vocab > 256 and codec.is_bytes:
        # the graph may generate any id of its vocabulary, and an id past 255 is no byte
        raise DataError(
            f"the tokenizer ({codec.name}) has one token per byte, but the graph's vocabulary has {vocab} "
            "tokens: pass the model's own tokenizer with --tokenizer FOLDER"
        )
    if vocab and max(ids) >= vocab:
        raise DataError(
            f"the tokenizer ({codec.name}) gave token id {max(ids)}, beyond the graph's vocabulary of "
            f"{vocab}: pass the model's own tokenizer with --tokenizer FOLDER"
        )
    context = layout.get("max_positions")
    # the last token generated is never fed back: a prompt and N new tokens take len + N - 1 positions
    room = context + 1 - len(ids) if context else None
    if max_new_tokens is None:  # the default: 64, within what the context leaves
        max_new_tokens = DEFAULT_NEW_TOKENS if room is None or room < 1 else min(DEFAULT_NEW_TOKENS, room)
    if room is not None and max_new_tokens > room:
        fix = (
            f"shorten the prompt or lower --max-new-tokens to {room}"
            if room > 0
            else f"shorten the prompt to at most {context} tokens"
        )
        raise DataError(
            f"the prompt ({len(ids)} tokens) and --max-new-tokens {max_new_tokens} exceed the graph's "
            f"context of {context} positions; {fix}"
        )
    options = None
    if threads is not None:
        import onnxruntime as ort

        options = ort.SessionOptions()
        options.intra_op_num_threads = threads
    session = DecodeSession(onnx_path, options)
    stream = None if as_json else TextStream(codec, ids)

    def write(g) -> None:  # the text as it is generated, byte for byte (not through rich, below)
        sys.stdout.write(stream.chunk(g.text_tokens))
        sys.stdout.flush()

    if stream is not None:
        sys.stdout.write(prompt)
        sys.stdout.flush()
    g = run_generation(
        session,
        ids,
        max_new_tokens,
        seed=seed,
        temperature=temperature,
        top_k=top_k,
        on_token=write if stream is not None else None,
    )
    text = continuation(codec, ids, g.text_tokens)
    result = {
        "prompt": prompt,
        "text": text,
        "prompt_tokens": g.prompt,
        "tokens": g.tokens,
        "stopped": g.stopped,
        "mode": "greedy"
        if seed is None or temperature == 0  # temperature 0: the most likely token, as greedy
        else f"sampled (seed {seed}, temperature {temperature}, top-k {top_k})",
        "tokenizer": codec.name,
        "prefill_ms": round(g.prefill_seconds * 1e3, 3),
        "decode_tokens_per_second": round(g.tokens_per_second, 1),
    }
    if as_json:
        print_json(result)
        return
    # the rest of the text, byte for byte: not through rich, which reads ":smile:" as an emoji, expands tabs
    # and drops control characters
    sys.stdout.write(stream.chunk(g.text_tokens, final=True) + "\n")
    sys.stdout.flush()
    rows = [
        (k, str(result[k]))
        for k in ("mode", "tokenizer", "stopped", "prefill_ms", "decode_tokens_per_second")
    ]
    rows.insert(0, ("tokens", f"{len(g.prompt)} prompt + {len(g.tokens)} generated"))
    # on stderr: stdout holds the text alone (quantcli generate ... > out.txt)
    err.print(key_value_table(f"quantcli generate {onnx_path}", rows))
