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

from __future__ import annotations

from quantcli.lazy import lazy_getattr

# the names load their modules on first use: ``quantcli.verify.lm_text`` (generate's tokenizer) needs no torch
_LAZY = {
    "verify_onnx": "quantcli.verify.driver",
    "REPLAY_SAMPLES": "quantcli.verify.replay",
    "choose_provider": "quantcli.verify.sessions",
    "expected_scales": "quantcli.verify.structure",
    "MAX_REPLAY_OUTPUT": "quantcli.verify.verdict",
    "MAX_REPLAY_STEPS": "quantcli.verify.verdict",
    "MAX_RMS_RATIO": "quantcli.verify.verdict",
    "Check": "quantcli.verify.verdict",
    "VerifyReport": "quantcli.verify.verdict",
}

__all__ = list(_LAZY)

__getattr__ = lazy_getattr("quantcli.verify", _LAZY)
