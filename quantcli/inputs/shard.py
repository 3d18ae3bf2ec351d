"""A rank's share of the calibration data: batch ``i`` of the one-process batch list goes to rank ``i %
world_size``.

Strided rather than in contiguous blocks: the ranks' batch counts differ by one at most, and rank 0 holds
batch 0 (the example batch the checkpoint stores) whenever there is any batch. Calibration statistics do not
depend on batch order (:mod:`calibrators.distributed`), so the shard layout does not change the result.

What a rank reads:
- a directory of batch files (``.npz``/``.npy``/``.pt``, one batch per file, the format meant for large sets):
  only its own files, file ``i`` going to rank ``i % world_size`` (a ``.pt`` file holding a list of batches
  goes whole to its file's rank). With ``num_samples`` the cap needs every earlier file's sample count, so
  there each rank reads every file and keeps its own batches.
- a folder of images: every rank lists the files, and decodes only the images of its own batches.
- a single ``.npy`` or ``.pt`` file: memory-mapped (copy-on-write), so a rank reads only the pages of its own
  batches (a float64 array is converted, so read, whole).
- a ``.npz`` (a zip: an array is read whole) or a text file: every rank reads (and tokenizes) all of it, keeps
  its own batches and drops the others' at once.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from torch import nn

from quantcli import defaults
from quantcli.inputs.data import Batch, DataOptions, load_batches, load_data, refuse_rebatching

BATCH_FILES = (".npz", ".npy", ".pt")


def strided(batches: list, rank: int, world_size: int) -> list:
    """Rank ``rank``'s share of a batch list: batches ``rank, rank + world_size, ...``."""
    return list(batches[rank::world_size])


def batch_files(path: Path) -> list[Path] | None:
    """The directory's batch files in the one-process order, or ``None`` if it holds anything else."""
    if not path.is_dir():
        return None
    entries = [p for p in path.iterdir() if not p.name.startswith(".")]
    files = sorted(p for p in entries if p.is_file() and p.suffix.lower() in BATCH_FILES)
    return files if files and len(files) == len(entries) else None


def load_shard(
    path: str | Path,
    model: nn.Module,
    rank: int,
    world_size: int,
    batch_size: int | None = defaults.BATCH_SIZE,
    num_samples: int | None = None,
    options: DataOptions | None = None,
) -> tuple[list[Batch], dict[str, Any] | None]:
    """Rank ``rank``'s share of ``load_data(path, ...)``: ``(batches, preprocessing)`` with the batches at
    positions ``rank, rank + world_size, ...`` (for a directory of batch files: those of its files at these
    positions), reading as little of the others' data as the format allows (module docstring). A rank may get
    no batch."""
    path = Path(path)
    found = batch_files(path)
    if found is not None and options is not None:
        refuse_rebatching(path, "tensors", options)
    files = found if num_samples is None else None
    if files is None:
        return load_data(path, model, batch_size, num_samples, options, shard=(rank, world_size))
    return [b for f in strided(files, rank, world_size) for b in load_batches(f, model, None)], None
