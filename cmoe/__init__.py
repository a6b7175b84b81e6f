"""cmoe: a tracing simulator and real-GPU executor for offloaded mixture-of-experts inference.

Reproduces and extends CommitMoE: padded expert slots, a GPU expert pool, layer-aware load
scheduling and a commit router that predicts the next layer's experts so that no expert falls
back to the CPU. See docs/formats.md for the formats, README.md for the code map.

The Python API (`cmoe.load_trace`, `cmoe.simulate`, `cmoe.execute`, `cmoe.CmoeError`) is in
`cmoe.api`, loaded on first use so that `import cmoe` imports nothing heavy.
"""

__version__ = "0.1.0"
__all__ = ["load_trace", "simulate", "execute", "CmoeError"]


def __getattr__(name: str):
    if name in __all__:
        from cmoe import api
        return getattr(api, name)
    raise AttributeError(f"module 'cmoe' has no attribute {name!r}")
