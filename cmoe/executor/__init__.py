"""The real executor: quantized experts in pinned host memory, a padded GPU slot pool, copy
streams with CUDA events, and the same policy objects the simulator replays."""
