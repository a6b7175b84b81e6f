"""CUDA C++ kernels for the executor, compiled at first use by NVRTC through PyTorch (`moe.py`)."""
