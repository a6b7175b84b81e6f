"""Names vulture reports that Python, a library or a file format reads (see tests/test_house.py).
Each line names the thing and says who reads it; this file is never imported."""
# ruff: noqa
# pyflakes: noqa

__getattr__  # cmoe/__init__.py: Python calls a module's __getattr__ for `cmoe.simulate` etc. (lazy API)
start_us  # cmoe/core/timeline.py Span fields: the Parquet timeline's columns
end_us  # (same)
_attn_implementation  # cmoe/executor/model.py: transformers reads config._attn_implementation
HX0  # cmoe/sim/replay/clock.py: names of Costs.hwf's positions, filled in order by replay/engine.py
HX1  # (same)
TFLOPS  # (same)
PARAMS  # (same, Costs.hwi)
skips  # cmoe/policy/base.py: a policy trait, read by name through trait(name, "skips")
