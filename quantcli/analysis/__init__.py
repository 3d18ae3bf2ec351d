"""Measuring a calibrated model: quality metrics, per-quantizer sensitivity, the analyze report (JSON, HTML)
and inspect."""
