"""What every command shares: one-line errors and exit codes. No logic lives in cli/."""

from __future__ import annotations

import functools
import sys

import typer

from cmoe.errors import CmoeError


def one_line_errors(fn):
    """Turn a CmoeError (and a broken pipe or Ctrl-C) into one line on stderr and exit code 2."""
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except CmoeError as e:
            typer.echo(f"error: {e}", err=True)
            raise typer.Exit(2) from None
        except KeyboardInterrupt:
            typer.echo("interrupted; nothing partial was kept", err=True)
            raise typer.Exit(130) from None
        except BrokenPipeError:
            sys.stderr.close()
            raise typer.Exit(1) from None
    return wrapper
