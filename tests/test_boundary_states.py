"""`benchmarks/boundary_states.py`'s loans: one folder, or `A+B` where B holds a later call's
measurements on A's loan, read beside A's without touching it."""

from __future__ import annotations

import pytest

from benchmarks.boundary_states import loan_runs
from tests.test_validate_table import _tar


@pytest.fixture
def loan(tmp_path):
    a = tmp_path / "a"
    (a / "pool20-b1" / "measured").mkdir(parents=True)
    (a / "results.json").write_text("{}")
    b = tmp_path / "b"
    b.mkdir()
    _tar(b / "meas-b8.tgz", {"pool20-b8/measured/metrics.json": "[]", "results.json": "{\"later\": 1}"})
    return a, b


def test_a_later_call_is_read_beside_the_first_which_stays_as_it_came(loan, tmp_path):
    a, b = loan
    folder, runs = loan_runs(f"{a}+{b}", tmp_path / "work")
    assert folder == a and runs == [a / "pool20-b1", tmp_path / "work" / "extra0" / "pool20-b8"]
    assert (a / "results.json").read_text() == "{}" and not (a / "pool20-b8").exists()
    assert not (tmp_path / "work" / "extra0" / "results.json").exists()     # only its measurements
    assert loan_runs(str(a), tmp_path / "work") == (a, [a / "pool20-b1"])


def test_a_later_call_that_is_not_one_is_one_line(loan, tmp_path):
    a, b = loan
    (b / "head.tgz").write_bytes(b"")                    # its own calibration: a loan of its own
    with pytest.raises(SystemExit) as e:
        loan_runs(f"{a}+{b}", tmp_path / "work")
    assert str(e.value) == (f"boundary_states.py: {b} must hold a later call's meas-bB.tgz on {a}'s loan and no "
                            "head.tgz (a calibration of its own): give such a folder on its own, not after +")
    (b / "head.tgz").unlink()
    (a / "pool20-b8").mkdir()                            # the same configuration measured twice
    with pytest.raises(SystemExit) as e:
        loan_runs(f"{a}+{b}", tmp_path / "work")
    assert str(e.value) == (f"boundary_states.py: {b} measured pool20-b8 again, which {a} has: one loan's calls "
                            "measure different batches")
