"""The `cmoe` command line: thin commands, each calling one library function. The commands live
by topic in cmoe/cli/*_cmds.py and are registered here, in the order `cmoe --help` lists them."""

from __future__ import annotations

from typing import Annotated, Optional

import typer

from cmoe import __version__
from cmoe.cli.common import OneLineGroup
from cmoe.cli.exec_cmds import calibrate, execute, quality, run_cmd
from cmoe.cli.report_cmds import report, validate
from cmoe.cli.sim_cmds import SWEEP_GRID, simulate, sweep
from cmoe.cli.trace_cmds import stats, trace

__all__ = ["SWEEP_GRID", "app", "calibrate", "execute", "main", "quality", "report", "run_cmd", "simulate", "stats",
           "sweep", "trace", "validate"]

app = typer.Typer(name="cmoe", no_args_is_help=True, add_completion=False, cls=OneLineGroup,
                  help="Trace, simulate and execute offloaded mixture-of-experts inference (CommitMoE and baselines).")


def _version(value: bool) -> None:
    if value:
        typer.echo(f"cmoe {__version__}")
        raise typer.Exit()


@app.callback()
def main(version: Annotated[Optional[bool], typer.Option("--version", callback=_version, is_eager=True,
                                                         help="Print the version and exit.")] = None) -> None:
    """cmoe: CommitMoE-style expert offloading, simulated and measured."""


for _command, _name in ((trace, None), (stats, None), (simulate, None), (sweep, None), (execute, None), (report, None),
                        (validate, None), (calibrate, None), (run_cmd, "run"), (quality, None)):
    app.command(name=_name)(_command)


if __name__ == "__main__":
    app()
