"""`cmoe report` and `cmoe validate`: an HTML report (or a Chrome trace), and predicted against measured."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated, Optional

import typer

from cmoe.cli.common import one_line_errors


@one_line_errors
def report(
    inputs: Annotated[list[Path], typer.Argument(metavar="INPUT...", help="A run folder (simulate/execute --out), a trace bundle folder or embedded (its statistics page), a sweep or timeline .parquet, or two run folders: predicted, then measured.")],
    *,
    out: Annotated[Optional[Path], typer.Option(help="HTML file to write (default: report.html in the folder, X.html beside X.parquet, compare.html in the measured folder, BUNDLE-stats.html beside a trace bundle, embedded-stats.html here for embedded).")] = None,
    max_spans: Annotated[int, typer.Option(min=1, help="Most timeline spans drawn; whole passes from the first are kept.")] = 100_000,
    chrome: Annotated[Optional[Path], typer.Option(help="Instead: export a timeline .parquet as Chrome Trace Event JSON (Perfetto) to this file.")] = None,
    quality: Annotated[Optional[Path], typer.Option(help="The JSON cmoe quality --out writes: with one run folder, adds the frontier (tokens/s against KL to exact routing, a point per policy).")] = None,
    force: Annotated[bool, typer.Option(help="Replace an existing --out or --chrome file.")] = False,
) -> None:
    """One self-contained HTML report (plotly.js embedded, works offline); or a Chrome trace export."""
    from cmoe.core.util import check_output
    for path, flag in ((out, "--out"), (chrome, "--chrome")):
        if path is not None:
            check_output(path, force, flag=flag)
    if chrome is not None:
        from cmoe.report.chrome import write_chrome_trace
        from cmoe.analysis.runfolder import read_timeline_file
        from cmoe.core.errors import CmoeError
        if len(inputs) != 1 or inputs[0].suffix != ".parquet":
            raise CmoeError("--chrome takes one timeline .parquet file (timeline-POLICY.parquet)")
        if quality is not None:
            raise CmoeError("--quality goes with an HTML report of one run folder, not --chrome")
        typer.echo(f"wrote {write_chrome_trace(read_timeline_file(inputs[0]), chrome)}")
        return
    from cmoe.report.build import build_report
    if [str(p) for p in inputs] == ["embedded"] and not inputs[0].exists():
        from cmoe.data import default_trace                  # the shipped trace: its page lands here, not
        inputs, out = [default_trace()], out or Path("embedded-stats.html")   # in the installed package
        check_output(out, force, flag="--out")
    typer.echo(f"report: {build_report(inputs, out, max_spans, quality)}")


@one_line_errors
def validate(
    predicted: Annotated[Path, typer.Argument(help="Folder written by cmoe simulate --out.")],
    measured: Annotated[list[Path], typer.Argument(help="Folder(s) written by cmoe execute --out (same trace, policy, pool, batch); several runs of one configuration also give the error against their mean and their spread.")],
    *,
    policy: Annotated[Optional[str], typer.Option(help="Comma-separated policies (default: every policy the measured run has).")] = None,
    out: Annotated[Optional[Path], typer.Option(help="JSON file for the errors (default: MEASURED/validation.json).")] = None,
    force: Annotated[bool, typer.Option(help="Replace an existing --out file (the default one is always rewritten).")] = False,
) -> None:
    """Predicted against measured: error per op kind, per layer, per token and end to end, and where it comes from."""
    from cmoe.core.util import check_output, write_text_atomic
    check_output(out or measured[0] / "validation.json", force or out is None)
    from cmoe.cli.common import policy_names
    from cmoe.analysis.validate import against_repeats, format_repeats, format_validation, validate_folders
    names = policy_names(policy, "--policy") if policy is not None else None
    runs = [validate_folders(predicted, m, names) for m in measured]
    for v in runs[0]:
        typer.echo(format_validation(v))
    doc: object = runs[0]
    if len(runs) > 1:
        rows = against_repeats(runs)
        typer.echo(f"against the mean of {len(runs)} measured runs:\n" + format_repeats(rows))
        doc = {"runs": runs, "against_mean": rows}
    path = write_text_atomic(out or measured[0] / "validation.json", json.dumps(doc, indent=1))
    typer.echo(f"wrote {path}")
    from cmoe.report.build import report_line
    typer.echo(report_line([predicted, measured[0]]))
