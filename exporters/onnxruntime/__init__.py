"""onnxruntime-specific graph passes: the placement it fuses, its CPU fusions, compatibility guards, what it
fuses (inspect --runtime) and its profiler."""
