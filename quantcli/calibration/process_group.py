"""One rank of a ``torch.distributed`` job: joining it from ``torchrun``'s environment, and one outcome for
all.

``torchrun`` starts one process per rank with ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR`` and
``MASTER_PORT`` set. :func:`join_from_environment` reads them, picks the rank's device (``cuda:LOCAL_RANK``
when there are GPUs, else the CPU) and initialises the default process group (NCCL on CUDA, Gloo on the CPU).

:func:`one_outcome` marks a step boundary: every rank runs the step; then one small collective tells every
rank whether any rank failed (one ``all_reduce`` of one integer), and if one did, every rank raises that error
(the lowest failing rank's), so a failure is reported once (by rank 0) and no rank is left waiting in a later
collective. Before it, a monitored barrier (Gloo's) waits at most the job's timeout (``--dist-timeout``) for
every rank, so a rank that stalls is named instead of hanging the others for Gloo's default 30 minutes; a rank
whose process died is reported as such.
"""

from __future__ import annotations

import contextlib
import datetime
import os
import re
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

from calibrators.distributed import comm_device, world_size
from quantcli import defaults, errors
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
    """``(RANK, WORLD_SIZE, LOCAL_RANK)`` when launched by ``torchrun`` with more than one rank, else
    ``None``."""
    if "RANK" not in os.environ or "WORLD_SIZE" not in os.environ:
        return None
    try:
        rank, size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        local = int(os.environ.get("LOCAL_RANK", rank))
    except ValueError:
        raise QuantCliError(
            "RANK, WORLD_SIZE and LOCAL_RANK must be integers (as torchrun sets them)"
        ) from None
    return (rank, size, local) if size > 1 else None


class NoGpuForRank(QuantCliError):
    """This rank's LOCAL_RANK has no GPU (the other ranks may have theirs)."""


def rank_device(device: str, local_rank: int) -> torch.device:
    """The device of the rank with ``local_rank`` for ``--device`` ``auto``, ``cpu`` or ``cuda``."""
    if device == "cpu" or (device == "auto" and not torch.cuda.is_available()):
        return torch.device("cpu")
    if device not in ("auto", "cuda"):
        raise QuantCliError(
            f"--device {device}: under torchrun every rank uses cuda:LOCAL_RANK; "
            "pass --device cuda, auto or cpu"
        )
    if not torch.cuda.is_available():
        raise QuantCliError(
            "--device cuda was asked for, but no CUDA GPU is available; use --device cpu or auto"
        )
    if local_rank >= torch.cuda.device_count():
        raise NoGpuForRank(
            f"LOCAL_RANK {local_rank} has no GPU: {torch.cuda.device_count()} CUDA device(s) "
            "on this host; start at most that many processes per node"
        )
    return torch.device("cuda", local_rank)


DEFAULT_TIMEOUT = defaults.DIST_TIMEOUT  # seconds

_timeout = DEFAULT_TIMEOUT  # this job's, for the monitored barrier and messages
_monitor = None  # a Gloo group for the monitored barrier when the default group is NCCL


class JoinError(QuantCliError):
    """Joining the job failed. ``every_rank``: the same error on every rank (the arguments), reported by rank
    0 alone; otherwise this rank's own (its GPU, its connection), reported by the rank."""

    def __init__(self, message: str, rank: int, every_rank: bool):
        super().__init__(message)
        self.rank, self.every_rank = rank, every_rank


def join_from_environment(device: str = "auto", timeout: float = DEFAULT_TIMEOUT) -> Rank | None:
    """Join the job ``torchrun`` started (``None`` when not under ``torchrun`` or with one rank); collectives
    (and the rendezvous) give up after ``timeout`` seconds."""
    global _timeout, _monitor
    env = torchrun_environment()
    if env is None:
        return None
    rank, size, local = env
    if not timeout > 0:
        raise JoinError(f"--dist-timeout must be a positive number of seconds, got {timeout}", rank, True)
    try:
        dev = rank_device(device, local)
    except NoGpuForRank as e:
        raise JoinError(f"rank {rank}: {e}", rank, False) from None
    except QuantCliError as e:  # the arguments: the same on every rank
        raise JoinError(str(e), rank, True) from None
    backend = "nccl" if dev.type == "cuda" else "gloo"
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
    _timeout = float(timeout)
    if not dist.is_initialized():
        wait = datetime.timedelta(seconds=_timeout)
        try:
            dist.init_process_group(
                backend,
                rank=rank,
                world_size=size,
                timeout=wait,
                **({"device_id": dev} if dev.type == "cuda" else {}),
            )
            _monitor = dist.new_group(backend="gloo", timeout=wait) if backend != "gloo" else None
        except Exception as e:  # a rendezvous that cannot be reached, a port in use, ...
            raise JoinError(
                f"rank {rank}: cannot join the torch.distributed job ({backend}): {first_line(e)}",
                rank,
                False,
            ) from None
    return Rank(rank, size, local, dev, backend)


def leave() -> None:
    """Leave the job (destroy the default process group) if this process joined one."""
    global _monitor
    _monitor = None
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


class RankStalled(QuantCliError):
    """A rank did not reach a step boundary within the job's timeout, or its process ended. ``speak``: this
    rank must report it even if it is not rank 0 (rank 0 is the one that stalled)."""

    def __init__(self, message: str, speak: bool = False):
        super().__init__(message)
        self.speak = speak


_TEST_STALL = "QUANTCLI_TEST_STALL"  # tests: "<rank>:<marker file>": that rank writes the file, then waits


def _test_stall(rank: int) -> None:
    hook = os.environ.get(_TEST_STALL, "")
    if hook.partition(":")[0] == str(rank):
        with open(hook.partition(":")[2], "w") as f:
            f.write(str(os.getpid()))
        while True:
            time.sleep(0.05)


def _the_other_rank() -> int | None:
    """In a job of two ranks, the one that is not this process (the one a closed connection leads to)."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() != 2:
        return None
    return 1 - dist.get_rank()


def explain(e: BaseException) -> QuantCliError | None:
    """A collective's failure in words (which rank stalled, or that one died); ``None`` when it is not one."""
    text = str(e)
    stalled = re.search(r"Ranks? ([\d, ]+) failed to pass monitoredBarrier", text)
    if stalled:
        ranks = stalled.group(1).strip(" ,")
        return RankStalled(
            f"rank {ranks} did not reach the step boundary within --dist-timeout "
            f"{_timeout:g} s: it "
            "stalled (or died); every rank stops. See that rank's output, or raise --dist-timeout if it is "
            "only slow"
        )
    if any(k in text for k in ("Connection closed by peer", "Connection reset by peer", "Broken pipe")):
        other = _the_other_rank()
        who = f"rank {other}'s process" if other is not None else "another rank's process"
        return RankStalled(
            f"{who} ended without reporting an error (killed, out of memory?); the job "
            "cannot go on: see torchrun's summary for which rank and why"
        )
    if "Timed out" in text or "timed out" in text:
        return RankStalled(
            f"a rank did not answer within --dist-timeout {_timeout:g} s (stalled or died); "
            f"every "
            "rank stops. Raise --dist-timeout if a rank is only slow"
        )
    return None


def _barrier(group) -> None:
    """Every rank reaches this point within the timeout, or the stalled ranks are named."""
    if group is not None or (_monitor is None and dist.get_backend() != "gloo"):
        return  # a sub-group (tests) or no Gloo group to monitor with
    try:
        dist.monitored_barrier(
            group=_monitor, timeout=datetime.timedelta(seconds=_timeout), wait_all_ranks=True
        )
    except RuntimeError as e:
        why = explain(e)
        if dist.get_rank() == 0 or why is None:
            raise (why or e) from None
        if "ended without reporting" in str(why):  # rank 0 left: it reports why
            raise why from None
        raise RankStalled(
            f"rank 0 did not answer at the step boundary within --dist-timeout {_timeout:g} "
            f"s: it "
            "stalled; every rank stops. See rank 0's output, or raise --dist-timeout if it is only slow",
            speak=True,
        ) from None


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
    _test_stall(rank)
    _barrier(group)
    flag = torch.tensor(
        [world - rank if failure is not None else 0], dtype=torch.long, device=comm_device(group)
    )
    try:
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=group)
    except RuntimeError as e:
        raise (explain(e) or e) from None
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


def broadcast_from_rank0(obj, group=None):
    """Collective: rank 0's ``obj`` on every rank (``obj`` itself with one rank); a picklable object."""
    if world_size(group) == 1:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=0, group=group)
    return box[0]


def sum_over_ranks(values: list[int], group=None) -> list[int]:
    """Element-wise sum of small integers over the ranks (``values`` itself with one rank)."""
    if world_size(group) == 1:
        return list(values)
    t = torch.tensor(values, dtype=torch.long, device=comm_device(group))
    dist.all_reduce(t, op=dist.ReduceOp.SUM, group=group)
    return [int(v) for v in t.cpu()]
