"""What every command shares: one-line errors and exit codes, and the checks of option values at
the boundary (numbers, lists, policy names), before any work. No logic lives in cli/.

Every way a command can fail reaches the user as one line starting `error:`, exit code 2:
a CmoeError from the library, a value typer refuses (a range, a type, an unknown option: see
`OneLineGroup`), a float that is not finite (every float option, by `one_line_errors`), and
running out of memory. Ctrl-C exits 130; the writers (cmoe.core.util) leave nothing partial behind.
"""

from __future__ import annotations

import functools
import math
import sys

import typer
from typer.core import TyperGroup
from typer.exceptions import TyperException

from cmoe.core.errors import CmoeError

OUT_OF_MEMORY = ("ran out of memory: give a smaller input (a shorter trace, fewer policies, a smaller batch) "
                 "or use a machine with more memory")


def _fail(message: str, code: int = 2):
    line = " ".join(message.split())
    typer.echo(f"error: {line}", err=True)
    raise typer.Exit(code) from None


class OneLineGroup(TyperGroup):
    """The `cmoe` group: typer's own refusals of a value (out of a min/max range, not a number, an
    unknown option) print as one `error:` line too, instead of a usage box."""

    def invoke(self, ctx):
        try:
            return super().invoke(ctx)
        except TyperException as e:
            if type(e).__name__ == "NoArgsIsHelpError":
                raise
            msg = e.format_message().strip().rstrip(".")
            where = e.ctx.command_path if getattr(e, "ctx", None) is not None else ctx.command_path
            _fail(f"{msg[:1].lower()}{msg[1:]} (see {where} --help)", getattr(e, "exit_code", 2) or 2)


def _check_finite(kwargs: dict) -> None:
    for name, v in kwargs.items():
        if isinstance(v, float) and not math.isfinite(v):
            raise CmoeError(f"--{name.replace('_', '-')} {v} is not a finite number: give a number like 20")


def one_line_errors(fn):
    """Turn a CmoeError (and a non-finite float option, running out of memory, a broken pipe or
    Ctrl-C) into one line on stderr and exit code 2 (130 for Ctrl-C)."""
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        try:
            _check_finite(kwargs)
            return fn(*args, **kwargs)
        except CmoeError as e:
            _fail(str(e))
        except MemoryError:
            _fail(OUT_OF_MEMORY)
        except KeyboardInterrupt:
            typer.echo("interrupted; nothing partial was kept", err=True)
            raise typer.Exit(130) from None
        except BrokenPipeError:
            sys.stderr.close()
            raise typer.Exit(1) from None
    return wrapper


def positive(value: float | None) -> float | None:
    """Option callback for sizes: a finite number above 0 (NaN, infinity, 0 and below refused)."""
    if value is not None and not (math.isfinite(value) and value > 0):
        raise typer.BadParameter(f"{value:g} is not a finite number above 0")
    return value


def gigabytes(value) -> float:
    """A size in GB as users write it: 20, 20.5, 20GB, 20G, "20 GB" (any case). Typer's parser for
    --pool-gb; `positive` then checks it is above 0."""
    if isinstance(value, (int, float)):
        return float(value)
    s = str(value).strip().lower().replace(" ", "")
    for suffix in ("gb", "g"):
        if s.endswith(suffix):
            s = s[: -len(suffix)]
            break
    try:
        return float(s)
    except ValueError:
        raise typer.BadParameter(f"'{value}' is not a size in GB (e.g. 20, 20GB or 20G)") from None


def one_of(new, old, new_flag: str, old_flag: str):
    """An option spelt two ways: the current name, or the name earlier versions used (still taken,
    hidden from --help). Giving both is refused."""
    if old is None:
        return new
    if new is not None:
        raise CmoeError(f"{old_flag} is the old name of {new_flag}: give one of them")
    return old


def device_name(device: str) -> str:
    """--device as given, with `auto` made concrete: cuda when a GPU is visible, else cpu."""
    if device != "auto":
        return device
    from cmoe.executor.run import resolve_device
    return resolve_device("auto").type


def numbers(text: str, flag: str, integer: bool = False) -> list:
    """A comma-separated list of finite numbers above 0 (whole ones with `integer`), at least one:
    sizes may carry a GB or G suffix."""
    try:
        xs = [gigabytes(x) for x in text.split(",") if x.strip()]
    except (ValueError, typer.BadParameter):
        raise CmoeError(f"{flag} '{text}' is not a comma-separated list of numbers") from None
    if not xs:
        raise CmoeError(f"{flag} '{text}' gives no value: the grid would be empty")
    bad = next((x for x in xs if not (math.isfinite(x) and x > 0) or (integer and x != int(x))), None)
    if bad is not None:
        raise CmoeError(f"{flag} has {bad:g}: give {'whole numbers' if integer else 'finite numbers'} above 0")
    return [int(x) for x in xs] if integer else xs


def names(text: str, flag: str) -> list[str]:
    """A comma-separated list of names, at least one."""
    xs = [x.strip() for x in text.split(",") if x.strip()]
    if not xs:
        raise CmoeError(f"{flag} '{text}' gives no value: give at least one")
    return xs


def every_policy(text: str | None) -> bool:
    """Whether a --policy value asks for every policy (None, the default, or 'all')."""
    return text is None or text.strip() == "all"


def policy_names(text: str | None, flag: str = "--policy") -> list[str]:
    """A comma-separated list of policies; None or 'all': every policy. Empty, unknown or repeated
    names are refused."""
    from cmoe.policy.policies import POLICIES
    if every_policy(text):
        return list(POLICIES)
    xs = [p.strip() for p in text.split(",") if p.strip()]
    if not xs:
        raise CmoeError(f"{flag} '{text}' names no policy: choose from {', '.join(POLICIES)} (or all)")
    bad = [p for p in xs if p not in POLICIES]
    if bad:
        raise CmoeError(f"unknown policy '{bad[0]}': choose from {', '.join(POLICIES)}")
    twice = next((p for p in xs if xs.count(p) > 1), None)
    if twice:
        raise CmoeError(f"{flag} names {twice} twice: give each policy once")
    return xs
