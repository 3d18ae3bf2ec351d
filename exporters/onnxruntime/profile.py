"""How long each node of an ONNX graph takes in onnxruntime, from onnxruntime's own profiler.

:func:`node_times` runs the graph the way a user deploys it (``InferenceSession(path)`` with default options:
``ORT_ENABLE_ALL``, the CPU provider) on one thread (:data:`THREADS`), so the nodes it times are those of the
graph onnxruntime runs after its fusions (:func:`exporters.onnxruntime.fusion.optimized_graph` saves the same
graph). Several graphs are timed interleaved, run by run, so that what they are compared on saw the same
machine load. The profiler writes one JSON trace per session (Chrome trace format); each executed node is an
event with ``cat == "Node"`` and ``name == "<node name>_kernel_time"``, its duration ``dur`` in microseconds.
"""

from __future__ import annotations

import functools
import json
import shutil
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np

from exporters.onnxruntime.fusion import PROVIDERS

_SUFFIX = "_kernel_time"

#: onnxruntime threads for timing: one, the setting the latency goals are stated in. With onnxruntime's
# default (one : per physical core) on a machine that also runs other work, a timing measures the contention
# as much as the kernels: : on 2 shared cores the zoo's int8 resnet took 1.34x-1.45x its float graph with 2
# threads and 1.05x-1.08x with 1.
THREADS = 1
#: consecutive runs of one graph per round; the first of them is not timed. Run one after another in single
# runs, : each graph starts on caches the other graphs evicted, which a deployment that runs one model does
# not see: on : the zoo's resnet (64 samples) that put the int8 graph at 1.03x its float graph, 0.95x-0.98x in
# bursts
BURST = 5
#: each graph is timed until it has run at least this long (and at least ``rounds`` rounds, at most
# ``MAX_ROUNDS``): : a fixed 20 rounds of a 0.2 ms graph is 4 ms of measurement, which one scheduling hiccup
# decides
MIN_SECONDS = 0.3
MAX_ROUNDS = 400


def node_times(
    paths: list[str | Path],
    feeds: dict[str, np.ndarray],
    rounds: int = 20,
    provider: str = "cpu",
    threads: int | None = THREADS,
) -> list[dict[str, float]]:
    """Median time of each node of onnxruntime's optimized graph of each of ``paths``, in microseconds.

    The graphs are timed interleaved, run by run (graph 1, graph 2, graph 1, ...), so a change of the
    machine's load while they run weighs on all of them alike: what a comparison of their nodes needs.

    Args:
        feeds: the sessions' inputs, by input name (numpy arrays of the graphs' input types); each session
            gets the ones it declares.
        rounds: timed runs of each graph; one more run before them warms each session up and is not counted.
        threads: onnxruntime's intra-op threads (None: its default, one per physical core); see
            :data:`THREADS`.

    Nodes that did not run (a branch not taken) are absent. Raises what onnxruntime raises when a graph does
    not load or run. The profiles are written to a temporary folder that is removed before returning.
    """

    if rounds < 1:
        raise ValueError(f"rounds must be >= 1, got {rounds}")
    work = Path(tempfile.mkdtemp(prefix="quantcli-profile-"))
    try:
        sessions = _sessions(paths, feeds, provider, threads, profile_folder=work)
        for _ in range(rounds + 1):  # the first round warms up: first-run allocations and lazy kernel setup
            for sess, own in sessions:
                sess.run(None, own)
        traces = [json.loads(Path(sess.end_profiling()).read_text()) for sess, _ in sessions]
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return [_medians(events) for events in traces]


def _medians(events: list[dict]) -> dict[str, float]:
    """Per node, the median ``dur`` of its ``_kernel_time`` events, leaving out each node's first event (the
    warm-up run) when it has more than one."""
    by_node: dict[str, list[float]] = {}
    for e in events:
        name = e.get("name", "")
        if e.get("cat") == "Node" and name.endswith(_SUFFIX):
            by_node.setdefault(name[: -len(_SUFFIX)], []).append(float(e.get("dur", 0)))
    return {n: statistics.median(d[1:] if len(d) > 1 else d) for n, d in by_node.items()}


def time_interleaved(
    runs: list[Callable[[], object]],
    rounds: int = 20,
    burst: int = BURST,
    min_seconds: float = MIN_SECONDS,
    max_rounds: int = MAX_ROUNDS,
) -> list[float]:
    """Typical wall time of one call of each of ``runs``, in seconds, timed interleaved so that a change of
    the machine's load weighs on all of them alike.

    Each round runs every callable ``burst`` times in a row (the first call untimed: it refills the caches the
    other callables evicted) and keeps the median of the timed calls; the order of the callables alternates
    from round to round (forward, backward), so that none always runs right after the same other one. Rounds
    continue until every callable has ``rounds`` of them and ``min_seconds`` of timed calls, or ``max_rounds``
    rounds. The result is the median over rounds. One warm-up call of each precedes everything (first-run
    allocations)."""
    if rounds < 1 or burst < 1:
        raise ValueError(f"rounds and burst must be >= 1, got {rounds} and {burst}")
    for fn in runs:
        fn()
    medians: list[list[float]] = [[] for _ in runs]
    spent = [0.0 for _ in runs]
    order = list(range(len(runs)))
    r = 0
    while r < max(rounds, 1) or (min(spent) < min_seconds and r < max_rounds):
        for k in order if r % 2 == 0 else order[::-1]:
            times = []
            for j in range(burst):
                t = time.perf_counter()
                runs[k]()
                dt = time.perf_counter() - t
                if j or burst == 1:
                    times.append(dt)
            medians[k].append(statistics.median(times))
            spent[k] += sum(times)
        r += 1
    return [statistics.median(m) for m in medians]


def _sessions(
    paths: list[str | Path],
    feeds: dict[str, np.ndarray],
    provider: str,
    threads: int | None,
    profile_folder: Path | None = None,
):
    """``(session, its feeds)`` per path: default options but ``threads``; with ``profile_folder``,
    onnxruntime's profiler on, each session's trace written there."""
    import onnxruntime as ort

    sessions = []
    for i, path in enumerate(paths):
        so = ort.SessionOptions()
        so.log_severity_level = 4  # fatal only: the caller reports a failure once
        if profile_folder is not None:
            so.enable_profiling = True
            so.profile_file_prefix = str(profile_folder / f"profile{i}")
        if threads:
            so.intra_op_num_threads = so.inter_op_num_threads = threads
        sess = ort.InferenceSession(str(path), so, providers=[PROVIDERS[provider]])
        sessions.append((sess, {x.name: feeds[x.name] for x in sess.get_inputs()}))
    return sessions


def graph_times(
    paths: list[str | Path],
    feeds: dict[str, np.ndarray],
    rounds: int = 20,
    provider: str = "cpu",
    threads: int | None = THREADS,
) -> list[float]:
    """Typical wall time of one run of each of ``paths`` in milliseconds (:func:`time_interleaved`:
    interleaved rounds of bursts, the median), default session options but ``threads`` intra-op threads (None:
    onnxruntime's default). A path given twice gets two sessions: the A/A comparison that measures the
    timing's own noise."""
    sessions = _sessions(paths, feeds, provider, threads)
    runs = [functools.partial(sess.run, None, own) for sess, own in sessions]
    return [t * 1e3 for t in time_interleaved(runs, rounds)]
