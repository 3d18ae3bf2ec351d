"""The observing pass replayed as a CUDA graph (:mod:`quantcli.calibration.cuda_graph`, issue 38): what it
records, where it applies and where it steps aside, run on the CPU with the graph's capture replaced by
running the captured step again at each replay (what the recorded kernels do); tests/test_cuda.py captures
real graphs.

Every calibration with ``cuda_graph=True`` is compared with the same calibration observed batch by batch (the
default): the amax and amin bit for bit, the refusals word for word."""

from __future__ import annotations

import contextlib
import copy

import pytest
import torch

import calibrators.scratch as scratch
from quantcli import quantize_model
from quantcli.calibration import cuda_graph
from quantcli.calibration.calibrate import calibrate
from quantcli.errors import CalibrationError
from quantcli.nn import quantizers


class _Replayed:
    """A capture's stand-in: each replay runs the captured step, with the slots in as when it was captured."""

    def __init__(self, owner: cuda_graph.GraphedPass) -> None:
        self.owner = owner

    def replay(self) -> None:
        with self.owner._slots_in():
            self.owner._step()


@pytest.fixture
def replayed(monkeypatch):
    """The device path on the CPU (batches kept and folded, as on a GPU), the CPU taken for a CUDA device by
    :func:`cuda_graph.plan`, and captures replaced by :class:`_Replayed`."""
    monkeypatch.setattr(scratch, "HOST_READ", set())
    plan = cuda_graph.plan
    monkeypatch.setattr(
        cuda_graph, "plan", lambda b, o, c, dev, alone: plan(b, o, c, torch.device("cuda"), alone)
    )
    monkeypatch.setattr(cuda_graph, "_side_stream", lambda dev: contextlib.nullcontext())
    monkeypatch.setattr(cuda_graph, "_capture", lambda step, dev: _Replayed(step.__self__))


class _Net(torch.nn.Module):
    """Two convolutions and a classifier; ``signed``: GELUs only (every input has negative values: each
    asymmetric quantizer keeps its min and max under entropy too)."""

    def __init__(self, reuse: bool = False, signed: bool = False):
        super().__init__()
        self.reuse, self.signed = reuse, signed
        self.a = torch.nn.Conv2d(3, 8, 3, padding=1)
        self.b = torch.nn.Conv2d(8, 8, 3, padding=1)
        self.head = torch.nn.Linear(8 * 6 * 6, 4)

    def forward(self, x):
        y = torch.nn.functional.gelu(self.a(x))
        act = torch.nn.functional.gelu if self.signed else torch.relu
        y = act(self.b(y))
        if self.reuse:  # one layer twice per pass: its quantizer observes two tensors a batch
            y = act(self.b(y))
        return self.head(y.flatten(1))


def _model(reuse=False, asymmetric=False):
    torch.manual_seed(0)
    config = {"asymmetric_activations": True} if asymmetric else None
    return quantize_model(_Net(reuse, signed=asymmetric).eval(), config)


def _batches(count=6, nan_at=None, shapes=None):
    g = torch.Generator().manual_seed(1)
    out = []
    for b in range(count):
        n = shapes[b] if shapes else 2
        out.append({"x": torch.randn(n, 3, 6, 6, generator=g) * (1 + b % 3)})
    if nan_at is not None:
        out[nan_at]["x"][1, 0, 2, 2] = float("nan")
    return out


def _state(model) -> dict:
    return {
        f"{n}.{a}": getattr(q, a)
        for n, q in quantizers(model).items()
        for a in ("amax", "amin")
        if getattr(q, a, None) is not None
    }


def _both(model, batches, method="max", dtype=None):
    """(replayed, batch by batch): the summaries and the states."""
    alone = copy.deepcopy(model)
    s1 = calibrate(model, batches, method, device="cpu", cuda_graph=True, dtype=dtype)
    s2 = calibrate(alone, batches, method, device="cpu", dtype=dtype)
    return s1, s2, _state(model), _state(alone)


METHODS = ("max", "entropy", "mse", "percentile")


@pytest.mark.parametrize("dtype", [None, "bfloat16"], ids=["float32", "bfloat16"])
@pytest.mark.parametrize("asymmetric", [False, True], ids=["symmetric", "asymmetric"])
@pytest.mark.parametrize("method", METHODS)
def test_replayed_batches_give_the_amax_of_batch_by_batch(method, asymmetric, dtype, replayed):
    """Every method, symmetric (max, or an ``|x|`` histogram) and asymmetric (min/max, or a two-sided
    histogram) quantizers, the model run in float32 or bfloat16: amax and amin bit for bit."""
    s1, s2, replayed_state, alone = _both(_model(asymmetric=asymmetric), _batches(), method, dtype)
    assert s1.graph_replays == 5 and s2.graph_replays == 0  # every batch after the first
    assert s1.num_batches == s2.num_batches == 6
    assert replayed_state.keys() == alone.keys() and len(alone) >= 3 + 2 * asymmetric
    for key, value in alone.items():
        assert torch.equal(replayed_state[key], value), key


def _observed(model, batches, method: str, graph: bool) -> dict:
    """The activation quantizers' calibrators after observing ``batches`` under ``method``: the first batch
    observed as ``calibrate()`` does, the others replayed (``graph``) or observed one by one."""
    qs = quantizers(model)
    acts = {n: q for n, q in qs.items() if not n.endswith("weight_quantizer") and q.enabled}
    for q in qs.values():
        if q.mode == "quantize":
            q.set_mode("disabled")
    for q in acts.values():
        q.start_calibration(method)
    graphed = cuda_graph.GraphedPass(acts, lambda b: model(**b), len(batches)) if graph else None
    with torch.inference_mode():
        model(**batches[0])
        if graphed is not None:
            graphed.capture(batches[1])
        for b in batches[1:]:
            graphed.replay(b) if graphed is not None else model(**b)
    if graphed is not None:
        graphed.finish()
    return {n: q.calibrator for n, q in acts.items()}


def _counts(c) -> tuple:
    """What a calibrator folded: its histograms' counts and ranges and its extremes, and its batch count."""
    from calibrators import HistogramCalibrator

    if isinstance(c, HistogramCalibrator):
        return (c.hist, c.range_exponent(), c.num_batches)
    if hasattr(c, "histogram"):  # two-sided
        return (c.histogram.hist, c.histogram.range_exponent(), *c.extremes.compute_range(), c.num_batches)
    return (*c._state(), c.num_batches) if hasattr(c, "_min") else (c.compute_amax(), c.num_batches)


@pytest.mark.parametrize("asymmetric", [False, True], ids=["abs", "two_sided"])
@pytest.mark.parametrize("rows", [1, 2, 8], ids=["fold_each_replay", "fold_every_two", "fold_at_the_end"])
def test_replayed_histograms_equal_batch_by_batch_count_for_count(asymmetric, rows, replayed, monkeypatch):
    """The histograms themselves, not only the amax searched from them: counted in pieces (each batch of the
    first layer, 216 values, in three of at most ``CHUNK``), over a history of ``rows`` rows (folded into the
    calibrators whenever it is full), with the quantizers of one input observed once."""
    import calibrators.counting as counting

    monkeypatch.setattr(counting, "CHUNK", 100)
    monkeypatch.setattr(scratch, "CHUNK", 100)
    monkeypatch.setattr(cuda_graph, "_history_rows", lambda replays, width: rows)
    model = _model(asymmetric=asymmetric)
    batches = _batches(count=7)
    batches[4]["x"] *= 40  # a batch that widens the range: earlier counts are re-binned
    want = _observed(copy.deepcopy(model), batches, "mse", graph=False)
    got = _observed(model, batches, "mse", graph=True)
    assert got.keys() == want.keys() and len(want) >= 3
    for name, c in want.items():
        expected, found = _counts(c), _counts(got[name])
        assert len(expected) == len(found) and expected[-1] == found[-1] == 7, name
        for e, f in zip(expected[:-1], found[:-1]):
            assert torch.equal(f, e), name


def test_a_non_finite_replayed_batch_is_refused_by_its_number(replayed):
    model = _model()
    with pytest.raises(CalibrationError) as replayed_error:
        calibrate(copy.deepcopy(model), _batches(nan_at=3), "max", device="cpu", cuda_graph=True)
    with pytest.raises(CalibrationError) as alone_error:
        calibrate(model, _batches(nan_at=3), "max", device="cpu")
    assert "calibration batch 3" in str(replayed_error.value)
    assert str(replayed_error.value) == str(alone_error.value)


@pytest.mark.parametrize("asymmetric", [False, True], ids=["symmetric", "asymmetric"])
@pytest.mark.parametrize("method", METHODS)
def test_every_replayed_calibrator_keeps_its_first_non_finite_batch(method, asymmetric, replayed):
    """A NaN in batch 4 (after a first history fold at two rows) reaches every layer: each calibrator, and
    each part of a two-sided one, reports batch 4, as observed batch by batch."""
    batches = _batches(count=7, nan_at=4)
    with pytest.MonkeyPatch.context() as m:
        m.setattr(cuda_graph, "_history_rows", lambda replays, width: 2)
        got = _observed(_model(asymmetric=asymmetric), batches, method, graph=True)
    want = _observed(_model(asymmetric=asymmetric), batches, method, graph=False)
    for name, c in want.items():
        for part, got_part in zip(c.parts(), got[name].parts()):
            got_part._flush()
            part._flush()
            assert got_part.first_nonfinite_batch() == part.first_nonfinite_batch() == 4, (name, part)


@pytest.mark.parametrize(
    "case",
    ["shapes", "auto", "few_batches", "reused_layer", "capture_fails"],
)
def test_the_batches_are_observed_one_by_one_where_a_graph_does_not_apply(case, replayed, monkeypatch):
    model, batches, method = _model(), _batches(), "max"
    if case == "shapes":  # a graph replays one shape
        batches = _batches(shapes=[2, 2, 3, 2, 2, 2])
    elif case == "auto":  # --method auto's hooks run per batch in Python: a replay would skip them
        method = "auto"
    elif case == "few_batches":
        batches = _batches(count=cuda_graph.MIN_BATCHES - 1)
    elif case == "reused_layer":  # the capture sees a quantizer called twice: refused
        model = _model(reuse=True)
    else:  # an operation that may not be captured (a read back to the host, on a GPU)

        def refuse(step, dev):
            raise RuntimeError("operation not permitted when stream is capturing")

        monkeypatch.setattr(cuda_graph, "_capture", refuse)
    s1, s2, replayed_state, alone = _both(model, batches, method)
    assert s1.graph_replays == 0
    for key, value in alone.items():
        assert torch.equal(replayed_state[key], value), key
    assert s1.to_dict()["graph_replays"] == 0


@pytest.mark.parametrize("rows, folds", [(None, [5]), (2, [2, 4, 5])], ids=["every_row", "two_rows"])
def test_the_history_is_folded_only_when_a_replay_needs_a_row(rows, folds, replayed, monkeypatch):
    """A history with a row for every replayed batch is folded once, after the last batch (nothing is
    dispatched between replays but their inputs' copies); a smaller one before the replay that finds it
    full, and at the end."""
    if rows is not None:
        monkeypatch.setattr(cuda_graph, "_history_rows", lambda replays, width: rows)
    seen = []
    fold = cuda_graph.GraphedPass._fold

    def counted(self):
        seen.append(self.replays)  # batches replayed when the fold ran
        fold(self)

    monkeypatch.setattr(cuda_graph.GraphedPass, "_fold", counted)
    s1, s2, replayed_state, alone = _both(_model(), _batches(), "entropy")
    assert s1.graph_replays == 5 and seen == folds
    for key, value in alone.items():
        assert torch.equal(replayed_state[key], value), key


def test_only_calibrators_a_replay_can_record_qualify():
    """Per-tensor max, min/max, ``|x|`` and two-sided histograms; not per channel, not with skipped zeros
    (a count per batch kept in Python)."""
    from calibrators import HistogramCalibrator, MaxCalibrator
    from calibrators.max import MinMaxCalibrator
    from calibrators.two_sided_calibrator import TwoSidedHistogramCalibrator

    assert cuda_graph.kind(MaxCalibrator()) == cuda_graph.kind(MinMaxCalibrator()) == "extremes"
    assert cuda_graph.kind(HistogramCalibrator()) == "abs"
    assert cuda_graph.kind(TwoSidedHistogramCalibrator()) == "signed"
    assert cuda_graph.kind(MaxCalibrator(axis=0)) is None
    assert cuda_graph.kind(HistogramCalibrator(axis=0)) is None
    assert cuda_graph.kind(HistogramCalibrator(skip_zeros=True)) is None


@pytest.mark.parametrize("method", ["max", "entropy"])
def test_a_graph_records_one_row_per_replay(method, replayed):
    """The history: one row per replayed batch, what each quantizer observed of that batch, in the order the
    pass calls them: its min and max, or its ``|x|`` counts over the batch's own range and that range."""
    import numpy as np

    model = _model()
    batches = _batches()
    qs = quantizers(model)
    acts = {n: q for n, q in qs.items() if n.endswith("input_quantizer")}
    for q in acts.values():
        q.start_calibration(method)
    graphed = cuda_graph.GraphedPass(acts, lambda b: model(**b), len(batches))
    with torch.inference_mode():
        for q in qs.values():
            if q.mode == "quantize":
                q.set_mode("disabled")
        graphed.capture(batches[1])
        for b in batches[1:4]:
            graphed.replay(b)
    assert graphed.names == ["a.input_quantizer", "b.input_quantizer", "head.input_quantizer"]
    assert int(graphed.row) == 3  # a capture records the step without running it; then three replays
    x = batches[3]["x"]
    row = graphed.history[2]
    if method == "max":
        assert graphed.width == 6  # (min, max) of each
        assert row[0] == x.min() and row[1] == x.max()
    else:
        # the image and the GELU's output: asymmetric (min and max); after the ReLU: |x| counts
        nb = acts["head.input_quantizer"].calibrator.num_bins
        assert graphed.width == 2 * 2 + nb + 1
        assert row[0] == x.min() and row[1] == x.max()
        with torch.no_grad():
            y = torch.nn.functional.gelu(
                torch.nn.functional.conv2d(x, model.a.weight, model.a.bias, padding=1)
            )
            h = torch.relu(torch.nn.functional.conv2d(y, model.b.weight, model.b.bias, padding=1)).numpy()
        q = 2.0 ** np.floor(np.log2(h.max()))  # the power of two with max |x| in [q, 2 q)
        # zeros are not counted (the fold puts them in bin 0 from the batch's size)
        expected, _ = np.histogram(h[h > 0] / q, bins=nb, range=(0.0, 2.0))
        assert float(row[4 + nb]) == q
        assert np.array_equal(row[4 : 4 + nb].numpy(), expected.astype(np.float32))
    assert not graphed.history[3:].any()


@pytest.mark.parametrize("flag, asked", [(None, False), ("--cuda-graph", True), ("--no-cuda-graph", False)])
def test_calibrate_cuda_graph_option_reaches_the_plan(flag, asked, tmp_path, monkeypatch):
    """``quantcli calibrate --cuda-graph`` asks whether a graph applies (on this CPU it never does:
    ``graph_replays`` 0); without it, or with ``--no-cuda-graph``, nothing asks."""
    import json

    from tests.helpers import cli

    seen = []
    plan = cuda_graph.plan
    monkeypatch.setattr(cuda_graph, "plan", lambda *a, **k: seen.append(a) or plan(*a, **k))
    args = ["calibrate", "digits_cnn", "--out", tmp_path / "d.calib.pt", "--json", "--num-samples", "128"]
    r = cli(*args, *([flag] if flag else []))
    assert r.exit_code == 0, r.output
    assert bool(seen) == asked
    assert json.loads(r.stdout)["graph_replays"] == 0


class _Graph:
    """A stand-in for ``torch.cuda.CUDAGraph`` that records how it was begun and ended."""

    def __init__(self) -> None:
        self.calls: list = []

    def capture_begin(self, **kwargs) -> None:
        self.calls.append(("begin", kwargs))

    def capture_end(self) -> None:
        self.calls.append(("end", {}))


@pytest.mark.parametrize("fails", [False, True], ids=["captured", "step_fails"])
def test_the_capture_is_relaxed_and_always_ended(fails, monkeypatch):
    """Captured in relaxed mode (``histc`` queries the free memory on each call, which the default mode may
    refuse), and ended even where the step fails, whose error is the one raised."""
    made: list[_Graph] = []
    monkeypatch.setattr(torch.cuda, "CUDAGraph", lambda: made.append(_Graph()) or made[-1])
    monkeypatch.setattr(cuda_graph, "_side_stream", lambda dev: contextlib.nullcontext())
    ran = []

    def step():
        ran.append(made[-1].calls[:])
        if fails:
            raise ValueError("a read back to the host")

    if fails:
        with pytest.raises(ValueError, match="a read back"):
            cuda_graph._capture(step, torch.device("cpu"))
    else:
        assert cuda_graph._capture(step, torch.device("cpu")) is made[0]
    assert ran == [[("begin", {"capture_error_mode": "relaxed"})]]
    assert made[0].calls == [("begin", {"capture_error_mode": "relaxed"}), ("end", {})]


def test_the_summary_says_when_cuda_graph_did_not_apply(tmp_path):
    """``calibrate --cuda-graph`` on the CPU calibrated batch by batch without a word."""
    from tests.helpers import cli

    r = cli("calibrate", "digits_cnn", "--cuda-graph", "--num-samples", "64", "--out", tmp_path / "c.pt")
    assert r.exit_code == 0, r.output
    assert "--cuda-graph did not apply" in r.output
    r = cli("calibrate", "digits_cnn", "--num-samples", "64", "--out", tmp_path / "c.pt")
    assert "cuda-graph" not in r.output
