#!/usr/bin/env bash
# Issue 38's checks on a machine with a CUDA GPU, in one go, with the machine's own torch (nothing installed over
# it): `pytest -m cuda`, then the GPU benchmark of five models x four methods (observed by a replayed CUDA graph,
# then batch by batch), then the amax searches and the max path's reductions on the GPU, then the CPU suite.
# Run from the repository root:
#
#     bash benchmarks/gpu_check.sh            # logs under $OUT (./gpu_check_out where OUT is not set)
#
# Every step has a time limit (`timeout`; 715 s in all, plus 5 s each to kill one that hangs), so the whole
# script ends within about 12.5 minutes on one H100/H200 whatever happens (about 5 when nothing hangs); a step that
# fails or times out is logged and the next one runs. The benchmark prints each row as it is measured, so a run
# cut short keeps what it measured. The summary of every step and its exit code goes to $OUT/gpu_check.log (124:
# it hit its limit).

set -u
OUT="${OUT:-$PWD/gpu_check_out}"
mkdir -p "$OUT"
LOG="$OUT/gpu_check.log"
export PYTHONUNBUFFERED=1
PY="${PYTHON:-python}"
: >"$LOG"

log() { echo "[$(date +%H:%M:%S)] $*" | tee -a "$LOG"; }

# step NAME SECONDS COMMAND...: run it with a time limit, its output in $OUT/NAME.txt, its exit code logged
step() {
    local name="$1" limit="$2"
    shift 2
    log "start $name (limit ${limit}s): $*"
    local t0=$SECONDS
    timeout --kill-after=5 "$limit" "$@" >"$OUT/$name.txt" 2>&1
    local rc=$?
    log "end   $name: exit $rc after $((SECONDS - t0))s ($(tail -n 1 "$OUT/$name.txt" | cut -c1-160))"
    return 0
}

log "repository $(git rev-parse --short HEAD 2>/dev/null || echo '?'), OUT=$OUT"

# 1. the machine: GPU, driver, torch (the image's own)
step environment 20 bash -c "nvidia-smi; $PY -c 'import torch, platform; \
print(\"torch\", torch.__version__, \"cuda\", torch.version.cuda, \"available\", torch.cuda.is_available()); \
print(torch.cuda.get_device_name(0) if torch.cuda.is_available() else \"no GPU\"); print(platform.platform())'"

# 2. this checkout importable without touching the image's torch: an editable install without dependencies (no
#    network needed: --no-build-isolation uses the installed setuptools); the checkout on PYTHONPATH either way
step install 45 "$PY" -m pip install -q --no-deps --no-build-isolation -e .
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"

# 3. what the tests and benchmarks import: missing ones are listed (the steps needing them then fail, logged)
step imports 30 "$PY" - <<'EOF'
import importlib
need = ["torch", "numpy", "typer", "rich", "yaml", "safetensors", "onnx", "onnxscript", "onnxruntime", "pytest",
        "hypothesis", "quantcli", "calibrators", "benchmarks.bench_gpu_calibration"]
missing = []
for name in need:
    try:
        m = importlib.import_module(name)
        print(f"ok       {name} {getattr(m, '__version__', '')}")
    except Exception as e:  # noqa: BLE001 - report every kind of import failure
        missing.append(name)
        print(f"MISSING  {name}: {type(e).__name__}: {e}")
print("missing:", ", ".join(missing) or "none")
EOF

# 4. the CUDA tests (sync-free calibration, op counts on CUDA, batched searches and bf16 calibration on the GPU)
step pytest_cuda 100 "$PY" -m pytest -q -m cuda -p no:cacheprovider --continue-on-collection-errors

# 5. the benchmark with the observing pass replayed as a CUDA graph (calibrate's cuda_graph=True; not yet run on a
#    GPU when written, its tests are in step 4): five models x four methods against a plain forward pass
step bench_gpu_graph 120 "$PY" -m benchmarks.bench_gpu_calibration --device cuda --rounds 2 --cuda-graph \
    --json "$OUT/bench_gpu_graph.json"

# 6. the same rows observed batch by batch (the default), as JSON too
step bench_gpu 120 "$PY" -m benchmarks.bench_gpu_calibration --device cuda --rounds 2 --json "$OUT/bench_gpu.json"

# 6b. the two runs side by side, and this session's batch-by-batch run against the last recorded one
step compare_graph 10 "$PY" -m benchmarks.compare_gpu_runs "$OUT/bench_gpu.json" "$OUT/bench_gpu_graph.json"
step compare_previous 10 "$PY" -m benchmarks.compare_gpu_runs benchmarks/results/bench_gpu_h200_efbc3f9.json \
    "$OUT/bench_gpu.json"

# 7. the amax searches on the GPU (one histogram, 768 per-channel ones), and collection against a matmul
step bench_calibrators 40 "$PY" -m benchmarks.bench_calibrators --device cuda --quick

# 7b. one batch's observed activations reduced five ways (aminmax, the infinity norm, _foreach_norm at the batch's
#     end, two stages, amin + amax): which reads them fastest, exactly and keeping a NaN (the max path's cost)
step bench_gpu_reductions 40 "$PY" -m benchmarks.bench_gpu_reductions --device cuda

# 8. the default test suite on this machine's CPU (a VNNI CPU on the lent machines: what CI meets on one), the
#    test files shared over 13 processes; the failing processes' logs in $OUT/suite/failures.txt
step suite 180 "$PY" .ci/parallel_pytest.py 13 "$OUT/suite" -m "not zoo and not cuda"

log "done in ${SECONDS}s; outputs: $(ls "$OUT" | tr '\n' ' ')"
