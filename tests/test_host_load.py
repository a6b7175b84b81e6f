"""The host-load sampler (`cmoe.calibrate.host_load`): /proc's text read exactly, windows as cores."""

import os
import sys
import time
from pathlib import Path

import pytest

from cmoe.calibrate import host_load
from cmoe.calibrate.host_load import LoadSampler, at, mean_over, parse_self, parse_stat, windows

STAT = """cpu  100 10 50 1000 20 3 7 40 5 0
cpu0 60 5 30 500 10 2 4 20 5 0
cpu1 40 5 20 500 10 1 3 20 0 0
intr 1 2 3
ctxt 99
"""


def test_stat_splits_process_interrupt_and_steal_ticks_and_counts_guest_once():
    # processes: user 100 + nice 10 + system 50 (guest 5 is inside user already); irq 3 + softirq 7
    assert parse_stat(STAT) == (160, 10, 40, 2)


def test_stat_with_too_few_fields_is_refused():
    with pytest.raises(ValueError, match="fewer than 8"):
        parse_stat("cpu 1 2 3\n")


def test_self_reads_user_and_system_past_a_name_with_spaces():
    text = "4242 (python foo) bar) R 1 2 3 4 5 6 7 8 9 10 123 45 0 0 20 0 1 0"
    assert parse_self(text) == 168


def test_windows_split_processes_into_ours_and_others_signed():
    samples = [(0.0, 1000, 50, 10, 300, 4), (0.5, 1150, 55, 20, 350, 4), (1.0, 1150, 55, 20, 352, 4),
               (1.0, 1160, 55, 20, 352, 4)]
    rows = windows(samples, 100)
    # 0.5 s = 50 ticks: 150 process ticks of which ours 50 -> 1.0 core ours, 2.0 others; irq 5 -> 0.1;
    # steal 10 -> 0.2; then ours counted 2 ticks the all-CPU count missed: -0.04 others, kept signed
    assert rows == [{"t0": 0.0, "t1": 0.5, "cpus": 4, "ours": 1.0, "other": 2.0, "irq": 0.1, "steal": 0.2},
                    {"t0": 0.5, "t1": 1.0, "cpus": 4, "ours": 0.04, "other": -0.04, "irq": 0.0, "steal": 0.0}]
    assert at(rows, 0.25) is rows[0] and at(rows, 0.5) is rows[1] and at(rows, 1.0) is None and at(rows, -1) is None
    assert at(rows, 0.75, [0.0, 0.5]) is rows[1]
    assert mean_over(rows[1:], 0.5, 1.0)["other"] == 0.0                   # clamped after averaging


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_the_sampler_sees_this_process_spin_and_restarts():
    s = LoadSampler(0.05)
    for _ in range(2):                                  # a second start samples again
        n = len(s.samples)
        with s:
            c0, w0 = time.process_time(), time.perf_counter()
            while time.process_time() - c0 < 0.4 and time.perf_counter() - w0 < 20:
                pass                                    # 0.4 s of this process's CPU, however busy the host
            time.sleep(0.12)                            # the thread's next sample falls after the spin
        rows = windows(s.samples[n:], host_load.HZ)
        assert len(rows) >= 4 and all(r["t1"] > r["t0"] for r in rows)
        # ~0.4 core-seconds, counted in 10 ms ticks
        assert sum(r["ours"] * (r["t1"] - r["t0"]) for r in rows) == pytest.approx(0.4, abs=0.06)
    assert s._child is None and s._file is None


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_the_sampler_runs_in_a_child_process_and_its_child_ends_with_its_parent(tmp_path):
    """No thread of this process wakes to sample (one did until the thirty-sixth session, and took
    the GIL from the executor's host ten times a second); a child whose process is gone stops."""
    import subprocess
    import threading
    before = threading.active_count()
    with LoadSampler(0.01) as s:
        assert threading.active_count() == before and s._child.poll() is None
        t0 = time.perf_counter()
        while len(s.samples) < 3 and time.perf_counter() - t0 < 20:
            time.sleep(0.01)
        assert len(s.samples) >= 3                       # read back while it samples
    assert s._child is None and s._file is None
    # a parent killed past its atexit (timeout's SIGTERM, a SIGKILL): its sampler's child ends, its file goes
    code = ("import sys, time; from cmoe.calibrate.host_load import LoadSampler; s = LoadSampler(0.01).start(); "
            "print(s._file, flush=True); time.sleep(60)")
    parent = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True,
                              cwd=Path(__file__).resolve().parents[1])
    left = Path(parent.stdout.readline().strip())
    assert left.is_file()
    parent.kill()
    parent.wait()
    t0 = time.perf_counter()
    while left.exists() and time.perf_counter() - t0 < 20:
        time.sleep(0.02)
    assert not left.exists()
    # called with a pid that is not its parent, the child returns at once and removes its file
    out = tmp_path / "samples.txt"
    out.write_text("")
    host_load._child(os.getpid() + 10**6, 0.001, str(out))
    assert not out.exists()


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_a_span_is_timed_by_two_snapshots():
    a = host_load.snapshot()
    time.sleep(0.02)
    (row,) = windows([a, host_load.snapshot()], host_load.HZ)
    assert row["t1"] - row["t0"] >= 0.02 and row["cpus"] >= 1


def test_without_proc_the_sampler_records_nothing(monkeypatch):
    monkeypatch.setattr(host_load, "STAT", Path("/nonexistent/stat"))
    with LoadSampler(0.01) as s:
        time.sleep(0.03)
    assert s.samples == [] and s.windows() == []


def test_a_span_s_load_weights_each_window_by_its_overlap():
    rows = [{"t0": 0.0, "t1": 1.0, "ours": 1.0, "other": 2.0, "irq": 0.0, "steal": 0.0},
            {"t0": 1.0, "t1": 2.0, "ours": 0.0, "other": 0.0, "irq": 0.5, "steal": 1.0}]
    assert mean_over(rows, 0.5, 2.0) == {"ours": 1.0 / 3, "other": 2.0 / 3, "irq": 1.0 / 3, "steal": 2.0 / 3}
    assert mean_over(rows, 2.0, 3.0) is None
