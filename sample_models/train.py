"""Re-train a sample model and rewrite its bundled weights and data: ``python -m sample_models.train NAME``.

Deterministic (fixed seeds, one thread); under a minute on a 2-core CPU, ``tiny_lm`` about 4 minutes (2500
steps), ``tiny_llama`` 15 to 30 minutes (1000 steps of 16 x 256 bytes; 30 on a shared machine).
``digits_cnn`` needs scikit-learn (``pip install -e .[train]``) for its bundled digits;
``text_encoder`` and ``tiny_lm`` read CPython's own standard library sources (``tiny_lm``: whole ``.py`` files
as bytes, every tenth file held out).
"""

from __future__ import annotations

import argparse
import ast
import contextlib
import random
import sysconfig
import time
from pathlib import Path

import numpy as np
import torch
from torch import nn


@contextlib.contextmanager
def _deterministic(seed: int = 0):
    """Seeded, one thread, deterministic kernels; the caller's settings come back afterwards."""
    state = (
        torch.are_deterministic_algorithms_enabled(),
        torch.get_num_threads(),
        torch.random.get_rng_state(),
    )
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True)
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(state[0])
        torch.set_num_threads(state[1])
        torch.random.set_rng_state(state[2])


def _targets(out_dir: Path | None, weights: Path, splits: Path) -> tuple[Path, Path]:
    """Where to write: the bundled files, or the same names under ``out_dir``."""
    if out_dir is None:
        return weights, splits
    out_dir.mkdir(parents=True, exist_ok=True)
    return out_dir / weights.name, out_dir / splits.name


def _save(model: nn.Module, path: Path) -> None:
    from safetensors.torch import save_file

    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(path))


def train_digits(out_dir: Path | None = None) -> float:
    with _deterministic():
        return _train_digits(out_dir)


def _train_digits(out_dir: Path | None) -> float:
    from sklearn.datasets import load_digits

    from sample_models import digits_cnn

    weights, splits = _targets(out_dir, digits_cnn.WEIGHTS, digits_cnn.SPLITS)
    digits = load_digits()
    pixels = digits.data.astype(np.uint8)
    labels = digits.target.astype(np.uint8)
    order = np.random.default_rng(0).permutation(len(labels))
    train, test = order[:1200], order[1200:]
    np.savez_compressed(
        splits,
        calib_x=pixels[train[:512]],
        calib_y=labels[train[:512]],
        eval_x=pixels[test],
        eval_y=labels[test],
    )
    x = torch.from_numpy(pixels[train].astype(np.float32) / 16).reshape(-1, 1, 8, 8)
    y = torch.from_numpy(labels[train].astype(np.int64))
    model = digits_cnn.DigitsCNN()
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    for _ in range(30):
        model.train()
        perm = torch.randperm(len(y))
        for i in range(0, len(y), 64):
            idx = perm[i : i + 64]
            opt.zero_grad()
            nn.functional.cross_entropy(model(x[idx]), y[idx]).backward()
            opt.step()
    model.eval()
    _save(model, weights)
    xt = torch.from_numpy(pixels[test].astype(np.float32) / 16).reshape(-1, 1, 8, 8)
    with torch.no_grad():
        return (model(xt).argmax(1).numpy() == labels[test]).mean()


def _stdlib_lines(limit_files: int = 400) -> tuple[list[str], list[str]]:
    """(prose, code): docstring lines and source lines of CPython's standard library."""
    root = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(p for p in root.glob("*.py"))[:limit_files]
    prose, code = set(), set()
    for f in files:
        try:
            src = f.read_text(encoding="utf-8")
            tree = ast.parse(src)
        except (SyntaxError, UnicodeDecodeError, ValueError):
            continue
        doc_lines = set()
        for node in ast.walk(tree):
            if (
                isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))
                and node.body
            ):
                first = node.body[0]
                if (
                    isinstance(first, ast.Expr)
                    and isinstance(getattr(first, "value", None), ast.Constant)
                    and isinstance(first.value.value, str)
                ):
                    doc_lines.update(range(first.lineno, first.end_lineno + 1))
                    for line in first.value.value.splitlines():
                        s = line.strip()
                        if 24 <= len(s) <= 78 and sum(c.isalpha() or c == " " for c in s) > 0.85 * len(s):
                            prose.add(s)
        for i, line in enumerate(src.splitlines(), start=1):
            s = line.strip()
            if i in doc_lines or s.startswith("#") or not 24 <= len(s) <= 78 or '"""' in s:
                continue
            code.add(s)
    return sorted(prose), sorted(code)


def _length_batches(lines: list[str], labels: list[int], batch: int):
    order = sorted(range(len(lines)), key=lambda i: len(lines[i]))
    return [[(lines[i], labels[i]) for i in order[k : k + batch]] for k in range(0, len(order), batch)]


def train_text(out_dir: Path | None = None) -> float:
    with _deterministic():
        return _train_text(out_dir)


def _train_text(out_dir: Path | None) -> float:
    from sample_models import text_encoder

    weights, splits = _targets(out_dir, text_encoder.WEIGHTS, text_encoder.SPLITS)
    prose, code = _stdlib_lines()
    rng = random.Random(0)
    rng.shuffle(prose)
    rng.shuffle(code)
    n = min(len(prose), len(code), 2500)
    lines = prose[:n] + code[:n]
    labels = [0] * n + [1] * n
    idx = list(range(len(lines)))
    rng.shuffle(idx)
    n_eval = 600
    test, train = idx[:n_eval], idx[n_eval:]
    model = text_encoder.TextEncoder()
    opt = torch.optim.AdamW(model.parameters(), lr=2e-3, weight_decay=0.01)
    train_batches = _length_batches([lines[i] for i in train], [labels[i] for i in train], 64)
    for _ in range(4):
        model.train()
        rng.shuffle(train_batches)
        for b in train_batches:
            toks = text_encoder.tokenize([s for s, _ in b])
            opt.zero_grad()
            nn.functional.cross_entropy(model(**toks), torch.tensor([y for _, y in b])).backward()
            opt.step()
    model.eval()
    _save(model, weights)
    arrays = {}
    calib = _length_batches([lines[i] for i in train[:256]], [labels[i] for i in train[:256]], 32)
    for k, b in enumerate(calib):
        for name, t in text_encoder.tokenize([s for s, _ in b]).items():
            arrays[f"calib_{k}_{name}"] = t.numpy().astype(np.int16)
    evals = _length_batches([lines[i] for i in test], [labels[i] for i in test], 50)
    eval_labels = []
    correct = 0
    for k, b in enumerate(evals):
        toks = text_encoder.tokenize([s for s, _ in b])
        for name, t in toks.items():
            arrays[f"eval_{k}_{name}"] = t.numpy().astype(np.int16)
        ys = [y for _, y in b]
        eval_labels += ys
        with torch.no_grad():
            correct += int((model(**toks).argmax(1) == torch.tensor(ys)).sum())
    arrays["eval_labels"] = np.array(eval_labels, dtype=np.uint8)
    np.savez_compressed(splits, **arrays)
    return correct / len(eval_labels)


def _stdlib_text(max_bytes: int = 1_200_000) -> tuple[bytes, bytes]:
    """(training text, held-out text): CPython's standard library ``.py`` files in name order, every tenth
    file held out, each side cut at ``max_bytes`` (whole files)."""
    root = Path(sysconfig.get_paths()["stdlib"])
    train, held = bytearray(), bytearray()
    for i, f in enumerate(sorted(root.glob("*.py"))):
        side = held if i % 10 == 0 else train
        if len(side) < max_bytes:
            side += f.read_bytes()
    return bytes(train), bytes(held)


def _windows(text: np.ndarray, starts: np.ndarray, length: int) -> np.ndarray:
    return np.stack([text[s : s + length] for s in starts])


def train_tiny_lm(out_dir: Path | None = None, steps: int = 2500) -> float:
    with _deterministic():
        return _train_tiny_lm(out_dir, steps)


def _train_tiny_lm(out_dir: Path | None, steps: int) -> float:
    """AdamW with a cosine schedule on random 64-byte windows of the training text; returns held-out
    perplexity."""
    from safetensors.torch import save_file

    from sample_models import tiny_lm

    weights, splits = _targets(out_dir, tiny_lm.WEIGHTS, tiny_lm.SPLITS)
    train, held = (np.frombuffer(t, dtype=np.uint8) for t in _stdlib_text())
    rng = np.random.default_rng(0)
    n = tiny_lm.MAX_LEN
    calib = _windows(train, rng.integers(0, len(train) - n, 256), n)
    evals = _windows(held, np.linspace(0, len(held) - n, 256).astype(np.int64), n)
    np.savez_compressed(splits, calib=calib, eval=evals)
    model = tiny_lm.TinyLM()
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01, betas=(0.9, 0.98))
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=3e-3, total_steps=steps, pct_start=0.05)
    model.train()
    for _ in range(steps):
        ids = torch.from_numpy(_windows(train, rng.integers(0, len(train) - n, 32), n).astype(np.int64))
        logits = model(ids)
        loss = nn.functional.cross_entropy(logits[:, :-1].reshape(-1, tiny_lm.VOCAB), ids[:, 1:].reshape(-1))
        opt.zero_grad()
        loss.backward()
        opt.step()
        sched.step()
    model.eval()
    save_file(
        {k: v.detach().to(torch.float16).contiguous() for k, v in model.state_dict().items()}, str(weights)
    )
    model = tiny_lm.build(pretrained=False)
    from safetensors.torch import load_file

    model.load_state_dict({k: v.to(torch.float32) for k, v in load_file(str(weights)).items()})
    batches = [{"input_ids": torch.from_numpy(evals[i : i + 32].astype(np.int64))} for i in range(0, 256, 32)]
    with torch.no_grad():
        return tiny_lm.perplexity(lambda ids: model(torch.from_numpy(ids)).numpy(), batches)


def train_tiny_llama(out_dir: Path | None = None, steps: int = 1000) -> float:
    with _deterministic():
        return _train_tiny_llama(out_dir, steps)


def _train_tiny_llama(out_dir: Path | None, steps: int) -> float:
    """AdamW with a one-cycle schedule on random 256-byte windows of the training text (the same CPython files
    as ``tiny_lm``, every tenth held out); returns held-out perplexity of the float16-stored weights."""
    from safetensors.torch import save_file

    from sample_models import tiny_llama

    weights, splits = _targets(out_dir, tiny_llama.WEIGHTS, tiny_llama.SPLITS)
    train, held = (np.frombuffer(t, dtype=np.uint8) for t in _stdlib_text())
    rng = np.random.default_rng(0)
    n = tiny_llama.CONTEXT
    calib = _windows(train, rng.integers(0, len(train) - n, 64), n)
    evals = _windows(held, np.linspace(0, len(held) - n, 64).astype(np.int64), n)
    np.savez_compressed(splits, calib=calib, eval=evals)
    model = tiny_llama.TinyLlama()
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01, betas=(0.9, 0.98))
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=3e-3, total_steps=steps, pct_start=0.05)
    model.train()
    vocab = model.config.vocab_size
    for _ in range(steps):
        ids = torch.from_numpy(_windows(train, rng.integers(0, len(train) - n, 16), n).astype(np.int64))
        logits = model(ids)
        loss = nn.functional.cross_entropy(logits[:, :-1].reshape(-1, vocab), ids[:, 1:].reshape(-1))
        opt.zero_grad()
        loss.backward()
        opt.step()
        sched.step()
    model.eval()
    stored = {k: v.detach().to(torch.float16).contiguous() for k, v in tiny_llama.stored_state(model).items()}
    save_file(stored, str(weights))
    model = tiny_llama.load_state(tiny_llama.TinyLlama(), stored).eval()
    batches = [
        {"input_ids": torch.from_numpy(evals[i : i + 16].astype(np.int64))} for i in range(0, len(evals), 16)
    ]
    with torch.no_grad():
        return tiny_llama.perplexity(lambda ids: model(torch.from_numpy(ids)).numpy(), batches)


TRAINERS = {
    "digits_cnn": train_digits,
    "text_encoder": train_text,
    "tiny_lm": train_tiny_lm,
    "tiny_llama": train_tiny_llama,
}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("name", choices=sorted(TRAINERS))
    parser.add_argument("--out", type=Path, default=None, help="write here instead of over the bundled files")
    args = parser.parse_args(argv)
    t0 = time.perf_counter()
    score = TRAINERS[args.name](args.out)
    what = "perplexity" if args.name in ("tiny_lm", "tiny_llama") else "accuracy"
    print(f"{args.name}: held-out {what} {score:.4f}, trained in {time.perf_counter() - t0:.1f} s")


if __name__ == "__main__":
    main()
