"""One rank of a ``torch.distributed`` job: joining it from ``torchrun``'s environment, and one outcome for all.

``torchrun`` starts one process per rank with ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR`` and
``MASTER_PORT`` set. :func:`join_from_environment` reads them, picks the rank's device (``cuda:LOCAL_RANK``
when there are GPUs, else the CPU) and initialises the default process group (NCCL on CUDA, Gloo on the CPU).

:func:`one_outcome` marks a step boundary: every rank runs the step; then one small collective tells every
rank whether any rank failed (one ``all_reduce`` of one integer), and if one did, every rank raises that error (the lowest failing rank's), so a
failure is reported once (by rank 0) and no rank is left waiting in a later collective.
"""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist

from calibrators.distributed import comm_device, world_size
from quantcli import errors
from quantcli.errors import QuantCliError, first_line


@dataclass(frozen=True)
class Rank:
    """This process's place in the job."""

    rank: int
    world_size: int
    local_rank: int
    device: torch.device
    backend: str


def torchrun_environment() -> tuple[int, int, int] | None:
    """``(RANK, WORLD_SIZE, LOCAL_RANK)`` when launched by ``torchrun`` with more than one rank, else ``None``."""
    if "RANK" not in os.environ or "WORLD_SIZE" not in os.environ:
        return None
    try:
        rank, size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        local = int(os.environ.get("LOCAL_RANK", rank))
    except ValueError:
        raise QuantCliError("RANK, WORLD_SIZE and LOCAL_RANK must be integers (as torchrun sets them)") from None
    return (rank, size, local) if size > 1 else None


def rank_device(device: str, local_rank: int) -> torch.device:
    """The device of the rank with ``local_rank`` for ``--device`` ``auto``, ``cpu`` or ``cuda``."""
    if device == "cpu" or (device == "auto" and not torch.cuda.is_available()):
        return torch.device("cpu")
    if device not in ("auto", "cuda"):
        raise QuantCliError(f"--device {device}: under torchrun every rank uses cuda:LOCAL_RANK; "
                            "pass --device cuda, auto or cpu")
    if not torch.cuda.is_available():
        raise QuantCliError("--device cuda was asked for, but no CUDA GPU is available; use --device cpu or auto")
    if local_rank >= torch.cuda.device_count():
        raise QuantCliError(f"LOCAL_RANK {local_rank} has no GPU: {torch.cuda.device_count()} CUDA device(s) "
                            "on this host; start at most that many processes per node")
    return torch.device("cuda", local_rank)


def join_from_environment(device: str = "auto") -> Rank | None:
    """Join the job ``torchrun`` started (``None`` when not under ``torchrun`` or with one rank)."""
    env = torchrun_environment()
    if env is None:
        return None
    rank, size, local = env
    dev = rank_device(device, local)
    backend = "nccl" if dev.type == "cuda" else "gloo"
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
    if not dist.is_initialized():
        try:
            dist.init_process_group(backend, rank=rank, world_size=size,
                                    **({"device_id": dev} if dev.type == "cuda" else {}))
        except Exception as e:  # a rendezvous that cannot be reached, a port in use, ...
            raise QuantCliError(f"rank {rank}: cannot join the torch.distributed job ({backend}): "
                                f"{first_line(e)}") from None
    return Rank(rank, size, local, dev, backend)


def leave() -> None:
    """Leave the job (destroy the default process group) if this process joined one."""
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


class RankFailed(QuantCliError):
    """Another rank failed with an error that is not a ``QuantCliError`` (a bug, an unforeseen input)."""


def _describe(e: BaseException | None) -> tuple[str, str] | None:
    if e is None:
        return None
    msg = first_line(e) if str(e).strip() else ""
    if isinstance(e, QuantCliError):
        return type(e).__name__, msg
    return "", f"{type(e).__name__}: {msg}"


def _error_of(kind: str, message: str) -> QuantCliError:
    cls = getattr(errors, kind, None) if kind else None
    if not (isinstance(cls, type) and issubclass(cls, QuantCliError)):
        cls = RankFailed
    return cls(message)


def agree(failure: BaseException | None, group=None) -> None:
    """Collective: raise on every rank when any rank passes a failure; return when none does.

    The failing rank re-raises its own exception; the others raise the same kind of ``QuantCliError`` with
    the message prefixed by the failing rank (``RankFailed`` for anything else). One ``all_reduce`` of one
    integer when no rank failed; the messages travel only when one did."""
    world = world_size(group)
    if world == 1:
        if failure is not None:
            raise failure
        return
    rank = dist.get_rank(group)
    flag = torch.tensor([world - rank if failure is not None else 0], dtype=torch.long, device=comm_device(group))
    dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=group)
    if int(flag) == 0:
        return
    failed = world - int(flag)  # the lowest failing rank
    outcomes: list = [None] * world
    dist.all_gather_object(outcomes, _describe(failure), group=group)
    if failed == rank:
        raise failure
    kind, message = outcomes[failed]
    raise _error_of(kind, f"rank {failed}: {message}") from None


@contextlib.contextmanager
def one_outcome(group=None):
    """A step boundary: the block runs on every rank, then every rank fails if any rank's block failed."""
    try:
        yield
    except Exception as e:
        agree(e, group)
        raise
    agree(None, group)


def sum_over_ranks(values: list[int], group=None) -> list[int]:
    """Element-wise sum of small integers over the ranks (``values`` itself with one rank)."""
    if world_size(group) == 1:
        return list(values)
    t = torch.tensor(values, dtype=torch.long, device=comm_device(group))
    dist.all_reduce(t, op=dist.ReduceOp.SUM, group=group)
    return [int(v) for v in t.cpu()]
