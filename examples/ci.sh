#!/usr/bin/env bash
# A CI job step: calibrate, export, verify with thresholds; fail the job if a check fails.
#   bash examples/ci.sh [WORKDIR]        (MODEL, CONFIG, MIN_COSINE, MIN_SNR may be set in the environment)
# quantcli's exit codes: 0 every check passed, 1 a numerical check failed, 2 bad usage or input.
set -euo pipefail
work="${1:-$(mktemp -d)}"
if [ ! -d "$work" ]; then  # bad usage: 2, as quantcli says it; 1 means a check failed
    echo "WORKDIR $work is not a directory: create it first, or leave it out for a temporary one" >&2
    exit 2
fi
model="${MODEL:-digits_cnn}"
config="${CONFIG:-int8}"
python -m quantcli calibrate "$model" --config "$config" --out "$work/$model.calib.pt" --json > "$work/calibrate.json"
python -m quantcli export "$work/$model.calib.pt" --onnx "$work/$model.onnx" --json > "$work/export.json"
status=0
python -m quantcli verify "$work/$model.onnx" --reference "$work/$model.calib.pt" \
    --min-cosine "${MIN_COSINE:-0.99}" --min-snr "${MIN_SNR:-20}" --report "$work/report.json" || status=$?
if [ "$status" -eq 1 ]; then
    echo "quantization check failed: see $work/report.json" >&2
elif [ "$status" -ne 0 ]; then
    echo "quantcli could not run the check (exit $status)" >&2
fi
exit "$status"
