"""One name per idea across the CLI: --policy, --trace, --profile, --tokens, --prompt-tokens and
--device mean the same in every command; sizes take 20, 20GB or 20G; the names earlier versions
used are still taken but hidden, and giving both spellings is refused; every default shows."""

from __future__ import annotations

import re

import pytest
from typer.testing import CliRunner

from cmoe.cli.app import app
from cmoe.cli.common import gigabytes

COMMANDS = ("trace", "stats", "simulate", "sweep", "execute", "validate", "calibrate", "run", "quality", "report")


def run(*args):
    return CliRunner().invoke(app, [str(a) for a in args], env={"COLUMNS": "250"})


@pytest.mark.parametrize("text,value", [("20", 20.0), ("20GB", 20.0), ("20G", 20.0), ("20 gb", 20.0),
                                        ("0.5g", 0.5), (16, 16.0)])
def test_sizes_in_gb(text, value):
    assert gigabytes(text) == value


def test_a_size_that_is_not_one_is_refused_in_one_line():
    r = run("simulate", "--trace", "embedded", "--pool-gb", "20TB")
    assert r.exit_code != 0
    assert "'20TB' is not a size in GB (e.g. 20, 20GB or 20G)" in r.output
    assert "Traceback" not in r.output


def test_simulate_reads_20gb_as_20():
    a = run("simulate", "--trace", "embedded", "--slots", 4, "--policy", "upper,ondemand", "--pool-gb", "20GB")
    b = run("simulate", "--trace", "embedded", "--slots", 4, "--policy", "upper,ondemand", "--pool-gb", 20)
    assert a.exit_code == b.exit_code == 0, a.output
    assert a.output == b.output


def test_old_names_still_work_and_both_are_refused():
    a = run("simulate", "--trace", "embedded", "--slots", 4, "--policies", "ondemand")
    b = run("simulate", "--trace", "embedded", "--slots", 4, "--policy", "ondemand")
    assert a.exit_code == b.exit_code == 0 and a.output == b.output
    r = run("simulate", "--trace", "embedded", "--policy", "upper", "--policies", "upper")
    assert r.exit_code != 0 and "--policies is the old name of --policy: give one of them" in r.output


@pytest.mark.parametrize("command", COMMANDS)
def test_help_shows_one_vocabulary_and_every_default(command):
    out = run(command, "--help").output
    for old in ("--policies", "--traces", "--profiles", "--max-new-tokens", "--decode-len", "--prompt-len"):
        assert old not in out, (command, old)
    # a default written into a help text must survive rich's markup (square brackets would vanish)
    assert not re.search(r"\(default: \s*\)", out)
    assert "write ." not in out


def test_synthetic_trace_takes_tokens_and_prompt_tokens(tmp_path):
    r = run("trace", "--synthetic", "olmoe-1b-7b", "--requests", 1, "--prompt-tokens", 5, "--tokens", 7,
            "--out", tmp_path / "t")
    assert r.exit_code == 0, r.output
    from cmoe.trace.load import load_trace
    t = load_trace(str(tmp_path / "t"))
    assert t.num_tokens == 12 and int(t.step.max()) == 11
