"""Traces: the HF tracer, the synthetic generator, bundle I/O and statistics."""
