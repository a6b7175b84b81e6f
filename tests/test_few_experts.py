"""Which kernel configuration a launch of n experts runs (`cmoe.executor.few_experts`): the pure
choice the lean engine's graphs and the host program's launches follow (their CPU twin of the GPU
test `test_lean_gpu.py::test_few_expert_graphs_change_no_decision`; the program's choice of graph is
`test_host_program.py::test_a_launch_of_few_experts_replays_its_twin`)."""

from __future__ import annotations

import pytest

from cmoe.core.errors import CmoeError
from cmoe.executor import few_experts as fe


def test_buckets_are_the_kernels_row_buckets():
    rows = (1, 2, 3, 4, 5, 8, 9, 16, 17, 33, 64, 200)
    assert [fe.bucket(r) for r in rows] == [1, 2, 4, 4, 8, 8, 16, 16, 32, 64, 64, 64]


def test_the_switch_is_on_unless_turned_off():
    assert fe.ON and fe.threshold(8, {}) == 3 and fe.twin(1, fe.threshold(8, {}))
    off, zero = {"CMOE_FEW_EXPERTS": "off"}, {"CMOE_FEW_EXPERTS": "0"}
    assert fe.threshold(8, off) == 0 and not fe.twin(1, fe.threshold(8, zero))


def test_the_switch_by_rows_and_experts():
    env = {"CMOE_FEW_EXPERTS": "on"}
    assert fe.FEW_BUCKET == 4 and fe.FEW_EXPERTS == {8: 3}
    assert [fe.threshold(r, env) for r in (1, 4, 5, 8, 9, 12, 16, 32)] == [0, 0, 3, 3, 0, 0, 0, 0]
    assert [fe.twin(n, fe.threshold(8, env)) for n in range(0, 9)] == [False, True, True, True] + [False] * 5
    assert [fe.twin(n, fe.threshold(16, env)) for n in (1, 2, 3)] == [False, False, False]
    # no twin where the bucket has none
    assert not fe.twin(1, fe.threshold(4, env)) and not fe.twin(1, fe.threshold(64, env))


def test_the_environment_overrides_or_turns_it_off():
    off, six = {"CMOE_FEW_EXPERTS": "0"}, {"CMOE_FEW_EXPERTS": "6"}
    assert fe.threshold(8, off) == 0 and not fe.twin(1, fe.threshold(8, off))
    assert fe.threshold(8, six) == 6 and fe.twin(6, fe.threshold(8, six)) and fe.threshold(16, six) == 0
    assert fe.threshold(2, {"CMOE_FEW_EXPERTS": "6"}) == 0              # only buckets that have one
    assert fe.threshold(8, {"CMOE_FEW_EXPERTS": " on "}) == 3 and fe.threshold(8, {"CMOE_FEW_EXPERTS": " "}) == 3
    assert fe.threshold(8, {"CMOE_FEW_EXPERTS": "OFF"}) == 0 and fe.threshold(8, {"CMOE_FEW_EXPERTS": "On"}) == 3
    for bad in ("a few", "-1", "yes", "2.5"):
        for rows in (1, 8, 64):                            # refused at every batch, not only where it applies
            with pytest.raises(CmoeError, match=f"CMOE_FEW_EXPERTS='{bad}': give on .*, off, or a whole number"):
                fe.threshold(rows, {"CMOE_FEW_EXPERTS": bad})


def test_what_a_run_and_a_calibration_record():
    """`describe` is what the profile and a run's metrics keep; its words read back (`_read`) give `threshold`."""
    assert fe.describe({"CMOE_FEW_EXPERTS": "off"}) == "off" and fe.describe({"CMOE_FEW_EXPERTS": "0"}) == "off"
    assert fe.describe({}) == fe.describe({"CMOE_FEW_EXPERTS": "on"}) == "8:3"
    assert fe.describe({"CMOE_FEW_EXPERTS": "2"}) == "8:2"
    assert _read("8:3 16:1") == {8: 3, 16: 1} and _read("off") == {} == _read("") == _read(None)
    for env in ({}, {"CMOE_FEW_EXPERTS": "off"}, {"CMOE_FEW_EXPERTS": "5"}):   # the thresholds, round trip
        assert all(_read(fe.describe(env)).get(fe.bucket(r), 0) == fe.threshold(r, env) for r in range(1, 65))


def _read(said):
    """A record's words back to {bucket: threshold}, unrecorded as off (what a reader of
    metrics.json or a profile does; nothing in cmoe needs it since no line compares them)."""
    return {int(b): int(n) for b, n in (part.split(":") for part in (said or "off").split() if part != "off")}


def test_a_profile_keeps_the_switch_and_refuses_other_words():
    from dataclasses import replace

    from cmoe.core.hw import H200, HardwareProfile
    assert H200.few_experts == ""
    p = replace(H200, few_experts="8:3 16:1")
    assert HardwareProfile.from_dict(p.to_dict()).few_experts == "8:3 16:1"
    for word in ("on", "8:3,16:1", "8 3", 3):
        with pytest.raises(CmoeError, match="few_experts"):
            replace(H200, few_experts=word)


def test_validate_prints_no_line_for_the_switch():
    """The profile's launch fit is made of upper's launches, which never switch: a calibration under
    another setting prices the runs' launches the same, so no setting differs in a way worth a line
    (`cmoe.analysis.cpu_settings`), whatever either side recorded."""
    from cmoe.analysis.cpu_settings import setting_notes
    v = lambda prof, runs, batch: {"few_experts": {"profile": prof, "runs": runs, "batch": batch},  # noqa: E731
                                   "op_kinds": {}}
    for prof, runs in ((None, "8:3"), ("8:3", None), ("off", "8:3"), ("8:3 16:1", "8:3"), ("8:3", "off")):
        for batch in (1, 6, 8, 16):
            assert setting_notes(v(prof, runs, batch)) == []
