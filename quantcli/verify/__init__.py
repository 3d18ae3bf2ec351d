"""``quantcli verify``: prove in onnxruntime that an exported graph computes what the calibrated model
computes, and that the graph a user deploys loads and runs.

One concept per module:

* :mod:`~quantcli.verify.sessions` -- the provider, the exact session (optimizations off) and the deployed one
  (default options), feeding batches.
* :mod:`~quantcli.verify.stats` -- streaming output statistics (memory independent of the data's size).
* :mod:`~quantcli.verify.structure` -- every quantizer's pair with exactly its scale and zero point; pruned
  (unused) vs missing.
* :mod:`~quantcli.verify.replay` -- per-quantizer evidence on a bounded sample: graph surgery, same-input
  codes, the replay of each float segment on onnxruntime's own values, end-to-end codes.
* :mod:`~quantcli.verify.outputs` -- the model's outputs, and which are class logits.
* :mod:`~quantcli.verify.verdict` -- the checks, their default thresholds, the report.
* :mod:`~quantcli.verify.driver` -- :func:`verify_onnx`, which runs them.
"""

from quantcli.verify.driver import verify_onnx
from quantcli.verify.replay import REPLAY_SAMPLES
from quantcli.verify.sessions import choose_provider
from quantcli.verify.structure import expected_scales
from quantcli.verify.verdict import MAX_REPLAY_OUTPUT, MAX_REPLAY_STEPS, MAX_RMS_RATIO, Check, VerifyReport

__all__ = [
    "verify_onnx",
    "VerifyReport",
    "Check",
    "choose_provider",
    "expected_scales",
    "REPLAY_SAMPLES",
    "MAX_REPLAY_STEPS",
    "MAX_REPLAY_OUTPUT",
    "MAX_RMS_RATIO",
]
