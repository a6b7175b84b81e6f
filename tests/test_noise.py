"""The calibration's noise verdict, on hand-made repeats: a point's spread is the relative IQR of its
repeats ((q75 - q25) / median); it is too wide over 25%, unless that is under 10 us of jitter; copy
time must grow with size and expert time with rows (a fall of over 5% and 10 us counts)."""

from __future__ import annotations

import pytest

from cmoe.core.errors import CmoeError
from cmoe.calibrate.profile_fit import Noise, noise, noise_of, run_verdict, spread, verdict

US = 1e-6
CLEAN = {
    "H2D pinned": {"unit": "bytes", "grows": True,
                   "points": [[65536, [12 * US, 12.5 * US, 13 * US]], [1048576, [30 * US, 31 * US, 30.5 * US]]]},
    # 2 rows a hair faster than 1 (1.4%, 1 us): the flat part of the hinge, not noise
    "expert": {"unit": "tokens", "grows": True, "points": [[1, [70 * US, 71 * US]], [2, [69 * US, 70 * US]]]},
    "round trip": {"unit": None, "grows": False, "points": [[None, [50 * US, 52 * US]]]},
}


def test_spread_is_the_relative_iqr():
    assert spread([1.0, 2.0, 4.0]) == 0.75                         # (3 - 1.5) / 2
    assert spread([3.0]) == 0.0
    assert spread([10.0, 1.0, 1.0, 1.0, 1.0]) == 0.0               # one slow repeat (the first, often) does not decide


def test_clean_measurements_are_quiet():
    n = noise(CLEAN)
    assert n.quiet and n.falls == () and n.wide == ()
    assert [(k, round(s, 4)) for k, s in n.spreads] == [("H2D pinned 64 KiB", 0.04), ("H2D pinned 1 MiB", 0.0164),
                                                        ("expert, 1 tokens", 0.0071), ("expert, 2 tokens", 0.0072),
                                                        ("round trip", 0.0196)]
    assert n.line() == ("calibration quiet (spreads within 25% or 10 us; widest 4.0% at H2D pinned 64 KiB); "
                        "copy and expert times grow with size and rows")


def test_a_wide_spread_is_noisy():
    wide = {**CLEAN, "expert": {"unit": "tokens", "grows": True,
                                "points": [[1, [70 * US, 140 * US, 72 * US]], [2, [71 * US, 72 * US]]]}}
    n = noise(wide)
    assert not n.quiet and n.falls == () and [k for k, _ in n.wide] == ["expert, 1 tokens"]
    assert n.line() == ("warning: calibration noisy: 1 point spread over 25% (worst 48.6% at expert, 1 tokens): "
                        "the machine was busy and the profile may be off; rerun cmoe calibrate on a quiet machine "
                        "(--strict refuses such a profile)")


def test_jitter_of_a_few_microseconds_and_curves_only_shown_are_not_judged():
    # as on a quiet H200: a 64 KiB copy spread 40% (4 us), a 256 KiB copy 1 us faster than 64 KiB,
    # pageable copies spread 60% and out of order
    quiet = {"H2D pinned": {"unit": "bytes", "grows": True,
                            "points": [[65536, [8 * US, 10 * US, 14 * US, 16 * US, 10 * US]],
                                       [262144, [7 * US, 7.1 * US, 7.2 * US]]]},
             "H2D pageable": {"unit": "bytes", "grows": True, "judged": False,
                              "points": [[65536, [60 * US, 100 * US, 140 * US]], [262144, [40 * US, 45 * US]]]}}
    n = noise(quiet)
    assert n.quiet and dict(n.spreads)["H2D pinned 64 KiB"] == pytest.approx(0.4)
    assert dict(n.spreads)["H2D pageable 64 KiB"] == pytest.approx(0.4)      # shown in the table all the same
    assert n.widest == ("H2D pinned 64 KiB", pytest.approx(0.4))            # the widest judged point


def test_a_curve_that_falls_is_noisy():
    # what a busy H200 gave: D2H at 4 MiB slower than at 16 MiB, each repeat close to the others
    falls = {**CLEAN, "D2H pinned": {"unit": "bytes", "grows": True,
                                     "points": [[2**24, [300 * US, 303 * US]], [2**22, [320 * US, 322 * US]]]},
             "expert": {"unit": "tokens", "grows": True, "points": [[1, [70 * US]], [8, [60 * US]], [4, [80 * US]]]}}
    n = noise(falls)
    assert n.wide == () and n.falls == ("expert, 8 tokens faster than 4 tokens", "D2H pinned 16 MiB faster than 4 MiB")
    assert n.summary() == "noisy: expert, 8 tokens faster than 4 tokens and 1 more curve falls"
    # a curve not asked to grow (the round trip, the host's layer time) may fall
    assert noise({"host, layer": {"unit": "tokens", "grows": False, "points": [[1, [9e-4]], [8, [5e-4]]]}}).quiet


def test_both_and_the_strict_refusal():
    both = {"D2H pinned": {"unit": "bytes", "grows": True, "points": [[2**22, [8e-5, 2e-4]], [2**24, [6e-5, 6.1e-5]]]}}
    n = noise(both)
    assert n.summary() == ("noisy: 1 point spread over 25% (worst 42.9% at D2H pinned 4 MiB) "
                           "and D2H pinned 16 MiB faster than 4 MiB")
    assert verdict(n, False, "m.json") == n.line()
    with pytest.raises(CmoeError) as e:
        verdict(n, True, "m.json")
    assert str(e.value) == ("calibration is too noisy to trust (" + n.summary() + "); no profile written, the "
                            "measurements are in m.json: rerun cmoe calibrate on a quiet machine, or without --strict")
    assert verdict(noise(CLEAN), True, "m.json") == noise(CLEAN).line()
    d = n.to_dict()
    assert d["quiet"] is False and d["falls"] == ["D2H pinned 16 MiB faster than 4 MiB"]
    assert d["wide"] == ["D2H pinned 4 MiB"] and d["spread_metric"] == "relative IQR"


def test_files_from_before_the_repeats_still_get_their_curves_checked():
    old = {"h2d": [(65536, 1e-5), (65536, 2e-5), (2**20, 3e-5)], "d2h": [(2**22, 9e-5), (2**24, 7e-5)],
           "expert": {"points": [(1, 7e-5), (2, 7.2e-5)]}}
    assert noise_of(old) == Noise(spreads=(), falls=("D2H pinned 16 MiB faster than 4 MiB",))


def test_gpu_only_runs_show_the_cpu_experts_repeats_without_judging_them():
    """`cmoe run` of GPU-only policies calibrates with OpenMP's threads sleeping: its CPU experts
    may spread and fall (1 to 4 tokens here: 1.0-1.9 ms, then 1.2 ms), which must not call the
    machine noisy for runs that never use them; a CPU-expert policy's run still judges them."""
    cpu = {"unit": "tokens", "grows": True, "points": [[1, [1000 * US, 1900 * US, 1500 * US]], [4, [1200 * US] * 3]]}
    m = {"repeats": CLEAN | {"CPU expert": cpu}}
    judged, shown = noise_of(m), noise_of(m, cpu_experts=False)
    assert [k for k, _ in judged.wide] == ["CPU expert, 1 tokens"] and judged.wide[0][1] == pytest.approx(0.3)
    assert judged.falls == () and not judged.quiet
    assert shown.quiet and shown.spreads == judged.spreads and shown.widest == noise(CLEAN).widest
    assert noise_of({"repeats": CLEAN}, cpu_experts=False) == noise(CLEAN)
    cpu["points"][1][1] = [500 * US] * 3                      # 4 tokens faster than 1: a fall, judged or not
    assert noise_of(m).falls == ("CPU expert, 4 tokens faster than 1 tokens",)
    assert noise_of(m, cpu_experts=False).falls == ()


def test_run_verdict():
    quiet, busy = noise(CLEAN), noise({"D2H pinned": {"unit": "bytes", "grows": True,
                                                      "points": [[2**22, [8e-5]], [2**24, [6e-5]]]}})
    assert run_verdict(busy, [0.36, 0.98], None) == (
        "noise: errors +36.0% to +98.0%; calibration noisy: D2H pinned 16 MiB faster than 4 MiB; one run, its own "
        "spread not measured (--repeat 3 measures it): recalibrate on a quiet machine before reading these errors")
    assert run_verdict(quiet, [0.05, -0.02], [0.01, 0.06]) == (
        "noise: errors -2.0% to +5.0%; calibration quiet (spreads within 25% or 10 us; widest 4.0% at H2D pinned "
        "64 KiB); repeated runs spread up to 6.0%: the runs' own noise is as large as the errors, which say little "
        "about the model")
    assert run_verdict(quiet, [0.2], [0.03]).endswith("repeated runs spread up to 3.0%: the errors stand above the "
                                                      "noise measured")
    assert run_verdict(None, [0.2], None) == (
        "noise: error +20.0%; calibration not measured (a profile without its measurements); one run, its own spread "
        "not measured (--repeat 3 measures it): nothing here measured the machine's noise")
    # the runs' host against the calibration's: within 20% it is named and the verdict stands; beyond,
    # the errors of what the host bounds follow the host
    assert run_verdict(quiet, [0.2], [0.03], [0.9, 1.15]).endswith(
        "repeated runs spread up to 3.0%; the runs' host took 0.90-1.15x its calibrated time per layer: the errors "
        "stand above the noise measured")
    assert run_verdict(quiet, [-0.07], None, [0.55]).endswith(
        "the runs' host took 0.55-0.55x its calibrated time per layer: the host ran at another speed than when it "
        "was calibrated: where the host bounds a policy, its error follows the host, not the model")
    # the runs' loads against the calibrated link: within 3% named only; beyond, the link decides
    assert run_verdict(quiet, [0.04], None, [1.1], [0.98, 1.02]).endswith(
        "their loads moved at 0.980-1.020x the calibrated link: the errors stand above the noise measured")
    assert run_verdict(quiet, [0.055], None, [1.1], [0.95, 1.02]).endswith(
        "their loads moved at 0.950-1.020x the calibrated link: the link ran at another speed than when it was "
        "calibrated: where the loads bound a policy, its error follows the link, not the model")
    # the runs' CPU experts against their calibration: within 5% named only; beyond, the host's CPU decides
    assert run_verdict(quiet, [0.04], None, [1.1], [1.0], [0.96, 1.05]).endswith(
        "their loads moved at 1.000-1.000x the calibrated link; their CPU experts took 0.96-1.05x their calibrated "
        "time: the errors stand above the noise measured")
    assert run_verdict(quiet, [-0.31], None, [1.1], [1.05], [0.6, 1.18]).endswith(
        "their CPU experts took 0.60-1.18x their calibrated time: the CPU experts ran at another speed than when "
        "they were calibrated: where they bound a policy, its error follows the host's CPU, not the model")
    # both drifted, as at this session's pool 26 batch 8 (host 1.06-1.36x, CPU experts 0.60-0.64x): both named
    assert run_verdict(quiet, [-0.31], None, [1.06, 1.36], None, [0.6, 0.64]).endswith(
        "their CPU experts took 0.60-0.64x their calibrated time: the host and its CPU experts ran at other speeds "
        "than when they were calibrated: where either bounds a policy, its error follows the host, not the model")
    assert run_verdict(quiet, [0.04], None, None, None, [0.94]).endswith(
        "their CPU experts took 0.94-0.94x their calibrated time: the CPU experts ran at another speed than when "
        "they were calibrated: where they bound a policy, its error follows the host's CPU, not the model")
