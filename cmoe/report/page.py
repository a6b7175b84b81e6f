"""Plotly figures as HTML: the first figure of a page carries plotly.js inline, so the page works
offline; the rest reference it."""

from __future__ import annotations


class Figures:
    """Figure divs; the first one carries plotly.js, inline."""

    def __init__(self):
        self.first = True

    def div(self, fig) -> str:
        import plotly.io as pio
        out = pio.to_html(fig, include_plotlyjs=self.first, full_html=False,
                          config={"responsive": True, "displaylogo": False})
        self.first = False
        return out
