"""The calibrate pipeline: the calibration loop, SmoothQuant, weight rounding (GPTQ, AWQ), mixed precision,
latency-aware placement and torchrun ranks."""
