"""cmoe: a tracing simulator and real-GPU executor for offloaded mixture-of-experts inference.

Reproduces and extends CommitMoE: padded expert slots, a GPU expert pool, layer-aware load
scheduling and a commit router that predicts the next layer's experts so that no expert falls
back to the CPU. See README.md for the formats and DESIGN notes.
"""

__version__ = "0.1.0"
