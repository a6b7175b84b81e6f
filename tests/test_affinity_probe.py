"""`benchmarks/affinity_probe.py`'s CPU parts: the CPU reference, the summary's ranges and each
reference's correlation with the slow share, and a bad `--arms` refused in one line before any work."""

from __future__ import annotations

import sys

import pytest

from benchmarks import affinity_probe as ap


def _run(policy, arm, slow, cpu, record, tok=100.0, host=20.0, after_cpu=None):
    return {"policy": policy, "arm": arm, "slow_share": slow, "cpu_us": cpu, "record_us": record,
            "launch_us": None, "replay_us": 5.0, "tok_s": tok, "host_us_per_layer": host,
            "after_cpu_us": after_cpu, "after_record_us": None, "after_launch_us": 2.0, "after_replay_us": 5.0}


def test_the_summary_reads_each_reference_against_the_slow_share(capsys):
    runs = [_run("ondemand", "free", 0.1, 900.0, 1.0, tok=100.0, host=15.0, after_cpu=1000.0),
            _run("ondemand", "free", 0.9, 1000.0, 3.0, tok=90.0, host=30.0, after_cpu=800.0),
            _run("ondemand", "free", 0.5, 950.0, None, tok=95.0, host=20.0, after_cpu=900.0),
            _run("oracle", "free", None, 5000.0, 9.0)]               # no boundary: no slow share, left out
    s = ap.summarize(runs, ["ondemand", "oracle"], ["free"])
    assert s["ondemand free"] == {"host_us_min": 15.0, "host_us_max": 30.0, "host_us_mean": pytest.approx(65 / 3),
                                  "slow_share_min": 0.1, "slow_share_max": 0.9, "tok_s_min": 90.0,
                                  "tok_s_max": 100.0, "tok_s_spread_pct": pytest.approx(10 / 95 * 100)}
    assert s["oracle free"]["slow_share_min"] is None and s["oracle free"]["slow_share_max"] is None
    assert s["r slow_share cpu_us"] == pytest.approx(1.0)
    assert s["r slow_share record_us"] is None            # two runs measured it: too few for an r
    assert s["r slow_share replay_us"] is None            # constant
    assert s["r slow_share launch_us"] is None            # not measured
    assert s["r slow_share after_cpu_us"] == pytest.approx(-1.0)     # the references after each run, read alike
    assert s["r slow_share after_launch_us"] is None and s["r slow_share after_record_us"] is None
    out = capsys.readouterr().out
    assert "oracle       free   host   20.0-  20.0 us/layer, tok/s 100.00-100.00 (0.0%), slow -" in out
    assert "r(slow share, cpu_us) = 1.00; after the run -1.00" in out and "r(slow share, replay_us) = -; after the run -" in out


def test_a_file_without_the_after_references_reads_none_for_them():
    runs = [{k: v for k, v in _run("ondemand", "free", sl, cpu, 1.0).items() if not k.startswith("after_")}
            for sl, cpu in ((0.1, 900.0), (0.9, 1000.0), (0.5, 950.0))]    # the fifty-first session's file
    s = ap.summarize(runs, ["ondemand"], ["free"])
    assert s["r slow_share cpu_us"] == pytest.approx(1.0)
    assert all(s[f"r slow_share after_{k}"] is None for k in ap.REFS)


def test_a_bad_arm_is_one_line(monkeypatch, tmp_path):
    monkeypatch.setattr(sys, "argv", ["affinity_probe.py", "--out", str(tmp_path / "a.json"), "--arms", "free,tied"])
    with pytest.raises(SystemExit) as e:
        ap.main()
    assert str(e.value) == "affinity_probe.py: --arms 'free,tied': name free, pinned or both, comma-separated"
    monkeypatch.setattr(sys, "argv", ["affinity_probe.py", "--out", str(tmp_path / "a.json"), "--core", "99999"])
    with pytest.raises(SystemExit) as e:
        ap.main()
    assert str(e.value).startswith("affinity_probe.py: --core 99999: CMOE_PIN_HOST=core:99999: core 99999 is not one")
    assert not (tmp_path / "a.json").exists()


@pytest.mark.gpu
@pytest.mark.skipif(not __import__("torch").cuda.is_available(), reason="needs CUDA")
def test_the_submit_references_time_each_call_on_a_gpu():
    got = ap.submit_references(reps=50)
    assert set(got) == {"record_us", "launch_us", "replay_us"}
    assert all(v is None or 0 < v < 1000 for v in got.values()) and got["replay_us"] is not None
