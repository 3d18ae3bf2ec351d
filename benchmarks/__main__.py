"""Run every benchmark: ``python -m benchmarks [--quick] [--device cuda]``."""

import argparse

from benchmarks import (
    bench_accuracy,
    bench_calibration,
    bench_calibrators,
    bench_deploy,
    bench_distributed,
    bench_end_to_end,
    bench_int8_transformers,
    bench_opset,
    bench_ort_fp8,
    bench_output_quantization,
    bench_saturation,
    bench_startup,
    bench_verify,
)

p = argparse.ArgumentParser(description=__doc__)
p.add_argument("--device", default="cpu")
p.add_argument(
    "--quick",
    action="store_true",
    help="skip the minutes-long per-candidate loop references; one run per row against onnxruntime",
)
a = p.parse_args()
bench_startup.main([])
print()
bench_calibration.main(["--device", a.device])
print()
bench_calibrators.main(["--device", a.device] + (["--quick"] if a.quick else []))
if a.device == "cpu":
    print()
    bench_end_to_end.main(["--quick"] if a.quick else [])
    print()
    bench_saturation.main([])
    print()
    bench_ort_fp8.main([])
    print()
    bench_verify.main([])
    bench_opset.main([])
    print()
    bench_int8_transformers.main(["--rounds", "10"] if a.quick else [])
    print()
    bench_deploy.main([])
    print()
    bench_accuracy.main(["--quick"] if a.quick else [])
    print()
    bench_output_quantization.main([])
print()
bench_distributed.main(["--device", a.device])
