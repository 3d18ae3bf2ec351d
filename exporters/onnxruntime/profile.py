"""How long each node of an ONNX graph takes in onnxruntime, from onnxruntime's own profiler.

:func:`node_times` runs the graph the way a user deploys it (``InferenceSession(path)`` with default options:
``ORT_ENABLE_ALL``, the CPU provider, onnxruntime's default threads), so the nodes it times are those of the
graph onnxruntime runs after its fusions (:func:`exporters.onnxruntime.fusion.optimized_graph` saves the same
graph). Several graphs are timed interleaved, run by run, so that what they are compared on saw the same
machine load. The profiler writes one JSON trace per session (Chrome trace format); each executed node is an
event with ``cat == "Node"`` and ``name == "<node name>_kernel_time"``, its duration ``dur`` in microseconds.
"""

from __future__ import annotations

import json
import shutil
import statistics
import tempfile
from pathlib import Path

import numpy as np

from exporters.onnxruntime.fusion import PROVIDERS

_SUFFIX = "_kernel_time"


def node_times(
    paths: list[str | Path], feeds: dict[str, np.ndarray], rounds: int = 20, provider: str = "cpu"
) -> list[dict[str, float]]:
    """Median time of each node of onnxruntime's optimized graph of each of ``paths``, in microseconds.

    The graphs are timed interleaved, run by run (graph 1, graph 2, graph 1, ...), so a change of the
    machine's load while they run weighs on all of them alike: what a comparison of their nodes needs.

    Args:
        feeds: the sessions' inputs, by input name (numpy arrays of the graphs' input types); each session
            gets the ones it declares.
        rounds: timed runs of each graph; one more run before them warms each session up and is not counted.

    Nodes that did not run (a branch not taken) are absent. Raises what onnxruntime raises when a graph does
    not load or run. The profiles are written to a temporary folder that is removed before returning.
    """
    import onnxruntime as ort

    if rounds < 1:
        raise ValueError(f"rounds must be >= 1, got {rounds}")
    work = Path(tempfile.mkdtemp(prefix="quantcli-profile-"))
    try:
        sessions = []
        for i, path in enumerate(paths):
            so = ort.SessionOptions()
            so.log_severity_level = 4  # fatal only: the caller reports a failure once
            so.enable_profiling = True
            so.profile_file_prefix = str(work / f"profile{i}")
            sess = ort.InferenceSession(str(path), so, providers=[PROVIDERS[provider]])
            sessions.append((sess, {x.name: feeds[x.name] for x in sess.get_inputs()}))
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


def graph_times(
    paths: list[str | Path], feeds: dict[str, np.ndarray], rounds: int = 20, provider: str = "cpu"
) -> list[float]:
    """Median wall time of one run of each of ``paths`` in milliseconds, default session options, the graphs
    run interleaved (one run of each per round, after one warm-up round) so that a change of load weighs on
    all alike."""
    import time

    import onnxruntime as ort

    if rounds < 1:
        raise ValueError(f"rounds must be >= 1, got {rounds}")
    sessions = []
    for path in paths:
        so = ort.SessionOptions()
        so.log_severity_level = 4
        sess = ort.InferenceSession(str(path), so, providers=[PROVIDERS[provider]])
        sessions.append((sess, {x.name: feeds[x.name] for x in sess.get_inputs()}))
    times: list[list[float]] = [[] for _ in sessions]
    for r in range(rounds + 1):
        for k, (sess, own) in enumerate(sessions):
            t = time.perf_counter()
            sess.run(None, own)
            if r:
                times[k].append((time.perf_counter() - t) * 1e3)
    return [statistics.median(t) for t in times]
