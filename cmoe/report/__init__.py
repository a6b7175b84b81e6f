"""Timelines out: Chrome Trace Event JSON; Plotly reports (coming)."""
