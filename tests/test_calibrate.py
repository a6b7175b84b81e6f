"""cmoe calibrate: the fitting recovers known parameters from synthetic measurements, and a real
CPU calibration writes a profile the simulator accepts."""

from __future__ import annotations

import json
import os
from dataclasses import replace

import numpy as np
import pytest

from cmoe.core.hw import GB, H200, load_profile
from cmoe.calibrate.measure_model import HOST_ROUNDS
from cmoe.calibrate.beside import beside
from cmoe.calibrate.profile_fit import fit_line, fit_profile


def test_fit_line_exact():
    assert fit_line([(0, 1.0), (1, 3.0), (3, 7.0)]) == pytest.approx((1.0, 2.0))
    assert fit_line([(5, 2.0)]) == (2.0, 0.0)


def _synthetic(p, expert_bytes=93_585_408, params=3 * 4096 * 14336, resident=100_000_000):
    """What an ideal machine described by profile p would measure."""
    sizes = [b for b, _ in p.h2d_pinned]
    return {
        "h2d": [(b, p.h2d_us(b) / 1e6) for b in sizes] + [(b, 2 * p.h2d_us(b) / 1e6) for b in sizes],  # a slow repeat
        "d2h": [(b, p.d2h_us(b) / 1e6) for b in sizes],
        "h2d_pageable": (2**26, 2**26 / (p.h2d_pageable_gbps * GB)), "hbm": (2**31, 2**31 / (p.hbm_gbps * GB)),
        "matmul": (2 * 4096**3, 2 * 4096**3 / (p.matmul_tflops * 1e12)), "launch": p.launch_us / 1e6,
        "copy_slowdown": p.copy_compute_slowdown,
        "expert": {"bytes": expert_bytes, "params": params, "bits": 4,
                   "points": [(t, p.expert_us(expert_bytes, 4, t, params) / 1e6) for t in (1, 2, 8, 64)]},
        "layer": {"resident_bytes": resident,
                  "points": [(t, (p.layer_us(t, resident) + p.attn_us_per_ctx_token * 32) / 1e6) for t in (1, 8)],
                  "context_points": [(k, (p.layer_us(1, resident) + p.attn_us_per_ctx_token * k) / 1e6)
                                     for k in (32, 2052.5)],
                  "pass_start_s": p.pass_start_us / 1e6, "head_s": p.head_us / 1e6,
                  "expert_in_model_s": p.expert_us(expert_bytes, 4, 1, params) / 1e6,
                  "predict_layer_s": p.predict_layer_us / 1e6, "commit_route_s": p.commit_route_us / 1e6,
                  "host": {"layer_points": [(t, p.host_layer(t) / 1e6) for t in (1, 8)],
                           "route_points": [(t, p.host_route(t) / 1e6) for t in (1, 8)],
                           "expert_points": [(t, p.host_expert(t) / 1e6) for t in (1, 8)],
                           "expert_tail_s": p.host_expert_tail_us / 1e6, "sync_s": p.host_sync_us / 1e6,
                           "load_s": p.host_load_us / 1e6,
                           "pass_start_s": p.host_pass_start_us / 1e6, "head_s": p.host_head_us / 1e6}},
        "expert_classes": [{"format": "bf16", "bytes": 352_321_536, "params": params, "bits": 16,
                            "points": [(t, p.expert_us(352_321_536, 16, t, params) / 1e6) for t in (1, 8)]}],
        "cpu_expert": {"bytes": expert_bytes, "points": [(1, 3e-3)]},           # isolated: overruled below
        "cpu_expert_in_model": {"points": [(t, p.cpu_expert_us(expert_bytes, t) / 1e6) for t in (1, 2, 5)]},
        "roundtrip": 1e-6, "roundtrip_in_model": p.roundtrip_us / 1e6,
        "cpu_step": {"lead": p.cpu_lead_us / 1e6, "gap": p.cpu_gap_us / 1e6, "tail": p.cpu_tail_us / 1e6,
                     "pass_start": p.cpu_pass_start_us / 1e6, "pass_gap": p.cpu_pass_gap_us / 1e6},
    }


def _link(latency_us: float, gbps: float, sizes=(64 * 1024, 2**20, 4 * 2**20, 16 * 2**20, 64 * 2**20, 256 * 2**20)):
    """(bytes, GB/s) points of a link that takes latency + bytes / bandwidth."""
    return tuple((b, b / (latency_us * 1e-6 + b / (gbps * GB)) / GB) for b in sizes)


def test_fitting_recovers_the_parameters_it_was_made_from():
    link = _link(18.0, 55.0)
    known = replace(H200, h2d_pinned=link, d2h_pinned=_link(22.0, 54.0), layer_fixed_us=1234.0, attn_us_per_token=7.5, cpu_expert_gbps=42.0,
                    expert_gbps=(("int4", 1500.0), ("bf16", 3100.0)), matmul_tflops=300.0, roundtrip_us=80.0,
                    hbm_gbps=4200.0,
                    pass_start_us=900.0, head_us=450.0, predict_layer_us=33.0, commit_route_us=41.0, launch_us=0.0,
                    attn_us_per_ctx_token=0.012,
                    host_layer_us=950.0, host_attn_us_per_token=6.0, host_sync_us=80.0, host_route_us=100.0,
                    host_route_us_per_token=5.0, host_expert_us=170.0, host_expert_us_per_token=0.5,
                    host_expert_tail_us=15.0, host_pass_start_us=700.0, host_head_us=380.0, host_load_us=45.0,
                    cpu_expert_us_per_token=650.0, cpu_lead_us=75.0, cpu_gap_us=25.0, cpu_tail_us=50.0,
                    cpu_pass_start_us=320.0, cpu_pass_gap_us=150.0)
    got = fit_profile("fit", _synthetic(known), known.gpu_mem_bytes, "test", "2026-11-29")
    for (b0, g0), (b1, g1) in zip(known.h2d_pinned, got.h2d_pinned):
        assert b0 == b1 and g1 == pytest.approx(g0)                    # the fast repeat wins
    assert got.h2d_queued_us == 0.0 and "h2d_queued_us" not in got.sources    # no queued loads measured
    m = _synthetic(known)
    m["layer"]["load_queue"] = [4 << 20, 4 * 1.048576 / known.h2d_pinned[-1][1] / 1e3 + 5e-6, 30]
    q = fit_profile("fit", m, known.gpu_mem_bytes, "test", "2026-11-29")
    assert q.h2d_queued_us == pytest.approx(5.0) and "h2d_queued_us" in q.sources
    assert q.h2d_pinned == got.h2d_pinned and "x1" not in q.sources["h2d_pinned"]
    seconds = 93_585_408 / (known.h2d_pinned[-1][1] * 1.02 * 1e9)             # expert-sized loads, 2% faster
    m["layer"]["load_queue"] = [93_585_408, seconds, 112]
    f = fit_profile("fit", m, known.gpu_mem_bytes, "test", "2026-11-29")
    assert f.h2d_queued(93_585_408) == pytest.approx(seconds * 1e6) and f.h2d_queued_us == 0.0
    assert f.h2d_pinned[0] == got.h2d_pinned[0] and f.h2d_pinned[-1][1] > got.h2d_pinned[-1][1] * 1.02
    assert "from 16 MiB up x1.0" in f.sources["h2d_pinned"]
    row = next(r for r in beside(f, m).splitlines() if r.startswith("H2D queued load 89.25 MiB"))
    assert row.split()[5:7] == [f"{seconds * 1e6:.1f}us"] * 2                 # measured, fitted
    assert [g for _, g in got.d2h_pinned] == pytest.approx([g for _, g in known.d2h_pinned])
    for f in ("hbm_gbps", "matmul_tflops", "launch_us", "layer_fixed_us", "attn_us_per_token", "cpu_expert_gbps",
              "roundtrip_us", "h2d_pageable_gbps", "copy_compute_slowdown", "pass_start_us", "head_us",
              "predict_layer_us", "commit_route_us", "attn_us_per_ctx_token", "host_layer_us", "host_attn_us_per_token", "host_sync_us", "host_route_us",
              "host_route_us_per_token", "host_expert_us", "host_expert_us_per_token", "host_expert_tail_us",
              "host_pass_start_us", "host_head_us", "cpu_expert_us_per_token", "host_load_us", "cpu_lead_us",
              "cpu_gap_us", "cpu_tail_us", "cpu_pass_start_us", "cpu_pass_gap_us"):
        assert getattr(got, f) == pytest.approx(getattr(known, f), rel=1e-6), f
    assert "around each CPU layer" in got.sources["cpu_gap_us"]
    assert dict(got.expert_gbps)["int4"] == pytest.approx(1500.0, rel=1e-6)
    assert dict(got.expert_gbps)["bf16"] == pytest.approx(3100.0, rel=1e-6)     # the other width, measured too
    assert "measured by cmoe calibrate on test, 2026-11-29" in got.sources["layer_fixed_us"]
    assert got.copy_fifo and got.launch_us == 0.0        # the executor's one copy stream; launching is the host's
    assert got.copy_attention_slowdown == got.copy_compute_slowdown == known.copy_compute_slowdown   # no loading
    assert "no side-stream copy" in got.sources["copy_attention_slowdown"]        # run: the proxy's for both
    m = _synthetic(known)
    m["copy_slowdown_matmul"] = 0.01                                              # (timed on a GPU)
    assert "paired rounds" in fit_profile("fit", m, known.gpu_mem_bytes, "t", "d").sources["copy_compute_slowdown"]
    m = _synthetic(known)
    m["layer"]["copy_slow"] = {"attention": 0.125, "expert": 0.0625}
    m["layer"]["readback_copy_s"], m["layer"]["launch_copy_s"], m["layer"]["start_copy_s"] = 12e-6, 14e-6, 20e-6
    own = fit_profile("fit", m, known.gpu_mem_bytes, "test", "2026-11-29")
    assert (own.copy_compute_slowdown, own.copy_attention_slowdown) == (0.0625, 0.125)
    assert own.readback_copy_us == pytest.approx(12.0) and got.readback_copy_us == 0.0
    assert own.launch_copy_us == pytest.approx(14.0) and got.launch_copy_us == 0.0
    assert own.start_copy_us == pytest.approx(20.0) and got.start_copy_us == 0.0
    assert own.sources["start_copy_us"].startswith("measured by cmoe calibrate on test") and "oracle" in own.sources["start_copy_us"]
    assert got.sources["start_copy_us"].startswith("not measured, so 0")
    assert [r.split()[-3:] for r in beside(own, m).splitlines() if r.startswith("pass start by a load, more")] == [
        ["20.0us", "20.0us", "-"]]                                                   # measured, fitted
    assert "pass start by a load" not in beside(got, _synthetic(known))
    assert "commit's loads" in own.sources["copy_compute_slowdown"]
    m["layer"]["copy_slow"] = {"attention": -0.01, "expert": None}       # too few spans: the proxy's
    own = fit_profile("fit", m, known.gpu_mem_bytes, "test", "2026-11-29")
    assert (own.copy_compute_slowdown, own.copy_attention_slowdown) == (known.copy_compute_slowdown, 0.0)
    table = beside(got, _synthetic(known))
    assert "layer (non-expert), 8 tok" in table
    # the context rows show their runs' spread, kept under another name in the repeats
    m = _synthetic(known) | {"repeats": {"layer, context": {"unit": "keys", "grows": False, "judged": False,
                                                           "points": [[32, [1e-4, 1.1e-4, 1.2e-4]]]}}}
    row, = [r.split() for r in beside(got, m).splitlines() if r.startswith("layer, 32 keys")]
    assert row[-1] == "9.1%"                               # relative IQR: (115 - 105) / 110


def test_a_launches_extra_beside_a_load_fits_a_fixed_part_and_a_factor():
    """`launch_fit` recovers extra = a + s x launch from launches at several sizes (the H200's:
    4.5 us and 3%), weighting each by its smaller side; under two sizes 20% apart, or with one part
    negative, it does what its docstring says; `fit_profile` takes it over commit's one factor and
    `beside` shows each point against the fit."""
    from cmoe.calibrate.profile_fit import launch_fit
    a, s = 4.5e-6, 0.03
    pts = [[b, n, q, q + a + s * q, nq, nb] for b, n, q, nq, nb in
           ((1, 2, 70e-6, 600, 2400), (8, 4, 140e-6, 900, 360), (8, 8, 229e-6, 88, 45))]
    assert launch_fit(pts) == pytest.approx((a, s))
    assert launch_fit(pts[:1]) is None and launch_fit([pts[0], [1, 2, 80e-6, 90e-6, 9, 9]]) is None
    # the line through these would start at -2.5 us: held at 0, the factor through the origin
    assert launch_fit([[1, 2, 70e-6, 70e-6 + 1e-6, 9, 9], [8, 8, 230e-6, 230e-6 + 9e-6, 9, 9]]) == pytest.approx(
        (0.0, (70 * 1 + 230 * 9) / (70**2 + 230**2)))
    assert launch_fit([[1, 2, 70e-6, 80e-6, 9, 9], [8, 8, 230e-6, 236e-6, 9, 9]]) == pytest.approx((8e-6, 0.0))
    known = H200
    m = _synthetic(known)
    m["layer"]["copy_slow"] = {"attention": 0.125, "expert": 0.0625}
    m["layer"]["launch_copy_points"] = pts
    got = fit_profile("fit", m, known.gpu_mem_bytes, "test", "2026-11-29")
    assert (got.copy_launch_us, got.copy_compute_slowdown) == pytest.approx((4.5, 0.03))
    assert got.copy_attention_slowdown == 0.125 and "3 points of (batch, experts a launch)" in got.sources["copy_launch_us"]
    assert got.wave_beside_copy(100.0, 40.0) == pytest.approx(60.0 * 1.03 + 40.0 + 4.5)
    rows = [r.split() for r in beside(got, m).splitlines() if r.startswith("launch of")]
    assert [r[:7] for r in rows] == [["launch", "of", "2", "beside", "a", "load,", "b1"],
                                     ["launch", "of", "4", "beside", "a", "load,", "b8"],
                                     ["launch", "of", "8", "beside", "a", "load,", "b8"]]
    assert [r[7] for r in rows] == [r[8] for r in rows] == ["76.6us", "148.7us", "240.4us"]   # measured, fitted
    del m["layer"]["launch_copy_points"]
    old = fit_profile("fit", m, known.gpu_mem_bytes, "test", "2026-11-29")
    assert old.copy_launch_us is None and old.copy_compute_slowdown == 0.0625


def test_launch_copy_points_read_a_run_in_microseconds_as_seconds():
    """`launch_copy_points` on an executor log (spans in us): launches of two experts (70 us quiet,
    77.1 beside a load) and of eight (229, 240.87), six of each side, give points in seconds, and
    the fit through them a fixed part of 5 us and 3%."""
    from types import SimpleNamespace

    from cmoe.calibrate.commit_steps import launch_copy_points
    from cmoe.calibrate.profile_fit import launch_fit
    from cmoe.core.timeline import Span
    spans = []
    for p_ in range(1, 7):
        t0 = 10_000.0 * p_
        spans.append(Span("gpu", p_, 1, "copy0", "load", 7, t0, t0 + 2_000.0, 1000))
        for layer, (t, n, dur) in enumerate(((t0 + 100.0, 2, 77.1), (t0 + 3_000.0, 2, 70.0),
                                             (t0 + 500.0, 8, 240.87), (t0 + 4_000.0, 8, 229.0)), start=1):
            spans += [Span("gpu", p_, layer, "compute", "expert", e, t + e * dur / n, t + (e + 1) * dur / n, 0)
                      for e in range(n)]
    log = SimpleNamespace(spans=spans, pass_us=[(q, True, 1, 0.0) for q in range(1, 7)])
    pts = launch_copy_points(log, 0, 8)
    assert pts == [[8, 2, pytest.approx(70e-6), pytest.approx(77.1e-6), 6, 6],
                   [8, 8, pytest.approx(229e-6), pytest.approx(240.87e-6), 6, 6]]
    assert launch_fit(pts) == pytest.approx((5e-6, 0.03))


def test_large_copies_follow_one_line_so_a_slow_size_does_not_move_an_experts_copy():
    """From 16 MiB up the link is latency plus bytes over bandwidth, through the smallest and the
    largest copy: a 64 MiB size that ran 9% slow (as one H200 calibration's did) leaves a 93.6 MB
    expert's copy where the link puts it; the small sizes keep their own measurements."""
    from cmoe.calibrate.profile_fit import curve
    lat, gbps, expert = 18e-6, 55.0, 93_585_408
    sizes = [64 * 1024, 2**20, 4 * 2**20, 16 * 2**20, 64 * 2**20, 256 * 2**20]
    secs = {b: lat + b / (gbps * GB) for b in sizes}
    secs[2**20] *= 1.3                                          # small sizes: kept as measured
    slow = {**secs, 64 * 2**20: secs[64 * 2**20] * 1.09}
    pts = [(b, s) for b, s in slow.items()] + [(b, 2 * s) for b, s in slow.items()]   # and a slower repeat
    got = replace(H200, h2d_pinned=curve(pts))
    assert got.h2d_us(expert) == pytest.approx((lat + expert / (gbps * GB)) * 1e6, rel=2e-3)
    assert dict(got.h2d_pinned)[2**20] == pytest.approx(2**20 / secs[2**20] / GB)
    interpolated = replace(H200, h2d_pinned=tuple((b, b / s / GB) for b, s in sorted(slow.items())))
    assert interpolated.h2d_us(expert) > 1.03 * got.h2d_us(expert)   # what the size-by-size curve said


def test_the_link_line_goes_through_the_median_of_the_rounds_largest_copy():
    """The largest copy timed again in later rounds (`h2d_rounds`): one round caught in a slow spell
    (as the tenth H200 session's calibration was, at 54.1 GB/s against 55.4 a minute before) does
    not set the line; the median of the rounds does, and without rounds the first round's best."""
    from cmoe.calibrate.profile_fit import curve
    lat, big = 18e-6, 256 * 2**20
    sizes = [64 * 1024, 16 * 2**20, 64 * 2**20, big]
    at = lambda gbps: [(b, lat + b / (gbps * GB)) for b in sizes]  # noqa: E731
    slow_first = at(51.0)
    calm = lat + big / (55.0 * GB)
    got = dict(curve(slow_first, [calm, calm * 1.002, calm * 0.998]))
    assert got[big] == pytest.approx(big / (calm * 1.001) / GB)         # four rounds: the middle two's mean
    assert dict(curve(slow_first))[big] == pytest.approx(big / (lat + big / (51.0 * GB)) / GB)
    assert dict(curve(slow_first, []))[big] == dict(curve(slow_first))[big]
    assert got[64 * 1024] == dict(curve(slow_first))[64 * 1024]       # the small sizes as measured


def test_a_kernel_that_walks_the_cache_is_priced_per_key_of_the_longest_row():
    """The lean engine's decode attention (`attention_walks_cache`): the same context points give
    the per-key cost as attn_us_per_cache_key, and none per key summed over rows."""
    known = replace(H200, attn_us_per_ctx_token=0.025, launch_us=0.0)
    m = _synthetic(known)
    plain = fit_profile("fit", m, known.gpu_mem_bytes, "test", "2026-12-01")
    lean = fit_profile("fit", m | {"attention_walks_cache": True}, known.gpu_mem_bytes, "test", "2026-12-01")
    assert plain.attn_us_per_ctx_token == pytest.approx(0.025) and plain.attn_us_per_cache_key == 0.0
    assert lean.attn_us_per_cache_key == pytest.approx(0.025) and lean.attn_us_per_ctx_token == 0.0
    assert lean.layer_fixed_us == pytest.approx(plain.layer_fixed_us)
    assert "attn_us_per_ctx_token" in plain.sources and "attn_us_per_cache_key" not in plain.sources
    assert "attn_us_per_cache_key" in lean.sources and "attn_us_per_ctx_token" not in lean.sources


def test_the_runs_a_long_cache_is_cut_into_are_priced_apart_from_the_keys():
    """The lean attention cuts each head's keys into runs sized by the cache (at most 16 of 64-key
    multiples): a short prompt in the long run's cache (2060 slots: 11 runs) beside the two context
    points (52 slots: one run; 2052.5 keys in 2060) gives the per-key cost and what each run past the
    first costs, exactly; without that point, or with a kernel that does not split, the per-key line
    of the two context points alone, as before."""
    from cmoe.core.hw import split_plan, split_runs
    known = replace(H200, attn_us_per_cache_key=0.004, launch_us=0.0, attn_us_per_split_run=0.3,
                    attn_split_max=16, attn_split_block=64)
    m = _synthetic(known)
    at = lambda keys, cache: (known.layer_us(1, 100_000_000) + 0.004 * keys + known.attn_split_us(cache)) / 1e6  # noqa: E731
    # the kernel's own rule (`kernels_triton.attention.splits` calls `split_plan`): runs of 64-key
    # multiples, at most 16; one without a split
    assert [split_runs(c, 16) for c in (1, 21, 52, 64, 65, 200, 320, 2052, 2060, 4096, 9000)] == \
        [1, 1, 1, 1, 2, 4, 5, 11, 11, 16, 16]
    assert split_runs(2060, 0) == split_runs(2060, 1) == 1
    assert [split_plan(c, 16) for c in (52, 65, 2060, 9000)] == [(1, 52), (2, 64), (11, 192), (16, 576)]
    assert split_plan(2060, 1) == (1, 2060)                     # mode "0": one program a head
    m["layer"] |= {"context_points": [(32, at(32, 52)), (2052.5, at(2052.5, 2060))], "context_caches": [52, 2060],
                   "split_point": [20.5, at(20.5, 2060), 2060]}
    m |= {"attention_walks_cache": True, "attn_split_max": 16, "attn_split_block": 64}
    got = fit_profile("fit", m, known.gpu_mem_bytes, "test", "2026-12-04")
    assert got.attn_us_per_cache_key == pytest.approx(0.004) and got.attn_us_per_split_run == pytest.approx(0.3)
    assert (got.attn_split_max, got.attn_split_block) == (16, 64)
    assert got.attn_split_us(320) == pytest.approx(1.2) and got.attn_split_us(52) == 0.0
    assert "attn_us_per_split_run" in got.sources
    for drop in ({"split_point"}, {"attn_split_max"}):
        old = fit_profile("fit", {k: v for k, v in m.items() if k not in drop}
                          | {"layer": {k: v for k, v in m["layer"].items() if k not in drop}},
                          known.gpu_mem_bytes, "test", "2026-12-04")
        assert old.attn_us_per_split_run == 0.0 and old.attn_split_max == 0
        assert old.attn_us_per_cache_key == pytest.approx((at(2052.5, 2060) - at(32, 52)) / 2020.5 * 1e6)


def test_cpu_calibration_gives_a_profile_the_simulator_runs(checkpoints, tiny_trace, tmp_path):
    from typer.testing import CliRunner

    from cmoe.cli.app import app
    out = tmp_path / "cpu.json"
    r = CliRunner().invoke(app, ["calibrate", "--device", "cpu", "--model", str(checkpoints["mixtral"]),
                                 "--quant", "fp32", "--out", str(out)])
    assert r.exit_code == 0, r.output
    assert "measured" in r.output and "fitted" in r.output
    assert "H2D pageable 16 MiB" in r.output and "D2H pageable 64 KiB" in r.output      # curves across sizes
    m = json.loads(out.with_suffix(".measurements.json").read_text())
    cpu_name = [ln.split(":", 1)[1].strip() for ln in open("/proc/cpuinfo") if ln.startswith("model name")][0]
    assert m["device"]["host"] == f"{cpu_name}, {len(os.sched_getaffinity(0))} cores"    # which host measured it
    from cmoe.calibrate.measure import CPU_TOKENS
    assert [t for t, _ in m["cpu_expert"]["points"]] == list(CPU_TOKENS)          # the isolated loop's shape
    runs = ("host, layer", "host, route", "host, one expert")                # the eager runs' means
    assert {"H2D pinned", "D2H pinned", "expert", "CPU expert", "round trip", *runs} <= set(m["repeats"])
    micro = {k: c for k, c in m["repeats"].items() if k not in ("expert in model", *runs)}
    assert all(len(ts) >= 3 for c in micro.values() for _, ts in c["points"])                # every repeat kept
    host = [ts for k in runs for _, ts in m["repeats"][k]["points"]]
    assert host and all(len(ts) == 2 * HOST_ROUNDS for ts in host)           # two runs a round
    from cmoe.calibrate.measure import LINK_ROUNDS
    assert len(m["h2d_rounds"]) == LINK_ROUNDS - 1 and all(t > 0 for t in m["h2d_rounds"])   # after each later step
    assert [f"H2D pinned 16 MiB, round {i}" in r.output for i in range(2, LINK_ROUNDS + 1)] == [True] * (LINK_ROUNDS - 1)
    assert len(m["noise"]["spread"]) == sum(len(c["points"]) for c in micro.values()) + len(host)
    route = next(x.split() for x in r.output.splitlines() if x.startswith("host, route, 1 tokens"))
    assert route[-1].endswith("%")                                       # its two runs' spread, shown
    assert m["noise"]["verdict"] in r.output.splitlines()                                   # printed, one line
    assert ["what", "measured", "fitted", "spread"] in [x.split() for x in r.output.splitlines()]
    prof = load_profile(str(out))
    assert prof.name == "cpu" and prof.layer_fixed_us > 0 and dict(prof.expert_gbps)["bf16"] > 0
    assert not prof.cpu_layer_unmeasured()             # `--policy all`: CPU experts ran inside the model
    assert json.loads(out.read_text())["sources"]["hbm_gbps"].startswith("measured by cmoe calibrate on cpu")
    r = CliRunner().invoke(app, ["simulate", "--trace", str(tiny_trace), "--profile", str(out), "--pool-gb", "0.2686",
                                 "--policy", "upper,commit"])
    assert r.exit_code == 0, r.output


def test_cmoe_run_calibrates_simulates_executes_and_validates(checkpoints, tiny_trace, tmp_path):
    from typer.testing import CliRunner

    from cmoe.cli.app import app
    out = tmp_path / "run"
    r = CliRunner().invoke(app, ["run", "--model", str(checkpoints["mixtral"]), "--trace", str(tiny_trace),
                                 "--device", "cpu", "--quant", "fp32", "--policy", "ondemand,commit",
                                 "--pool-gb", "0.2686", "--tokens", "4", "--repeat", "2", "--out", str(out), "--verbose"])
    assert r.exit_code == 0, r.output
    for f in ("profile.json", "profile.measurements.json", "predicted/metrics.json", "measured/metrics.json",
              "measured-2/metrics.json", "validation.json", "report.html"):
        assert (out / f).is_file(), f
    doc = json.loads((out / "validation.json").read_text())
    vals = doc["runs"][0]
    assert [v["policy"] for v in vals] == ["ondemand", "commit"]
    assert [r["policy"] for r in doc["against_mean"]] == ["ondemand", "commit"]
    assert all(len(r["measured"]) == 2 for r in doc["against_mean"]) and "against the mean of 2" in r.output
    pred = json.loads((out / "predicted" / "metrics.json").read_text())
    meas = json.loads((out / "measured" / "metrics.json").read_text())
    assert [m["experts_fit"] for m in pred] == [m["experts_fit"] for m in meas]     # one pool layout
    assert all(v["decode_passes"] == 4 for v in vals)
    assert "the error comes mostly from" in r.output
    line = next(x for x in r.output.splitlines() if x.startswith("noise: "))               # beside the errors
    assert line.startswith("noise: errors ") and "; calibration " in line and "repeated runs spread up to " in line


def test_weighted_line_counts_each_point_as_often_as_it_was_seen():
    # (0, 1) seen three times, (1, 3) once, (2, 9) once: the same as five unweighted points
    assert fit_line([(0, 1.0), (1, 3.0), (2, 9.0)], [3, 1, 1]) == \
        pytest.approx(fit_line([(0, 1.0), (0, 1.0), (0, 1.0), (1, 3.0), (2, 9.0)]))


def _measurements(tmp_path, repeats):
    """Measurements of a known machine with these repeats (`repeats(m)`), written for --refit."""
    m = _synthetic(replace(H200, launch_us=0.0, pass_start_us=1.0, head_us=1.0))
    m["device"] = {"label": "test gpu", "memory_bytes": H200.gpu_mem_bytes, "date": "2026-12-02"}
    m["repeats"] = repeats(m)
    path = tmp_path / "m.json"
    path.write_text(json.dumps(m))
    return path


def _noisy_measurements(tmp_path):
    """Measurements of a known machine, with repeats in which D2H at 16 MiB beat 4 MiB."""
    return _measurements(tmp_path, lambda m: {
        "H2D pinned": {"unit": "bytes", "grows": True, "points": [[b, [s, s * 1.01]] for b, s in m["h2d"]]},
        "D2H pinned": {"unit": "bytes", "grows": True, "points": [[2**22, [3.2e-4]], [2**24, [3.0e-4]]]}})


def test_refit_warns_on_noise_and_strict_refuses(tmp_path):
    from typer.testing import CliRunner

    from cmoe.cli.app import app
    raw, out = _noisy_measurements(tmp_path), tmp_path / "p.json"
    r = CliRunner().invoke(app, ["calibrate", "--refit", str(raw), "--out", str(out), "--strict"])
    assert r.exit_code == 2 and not out.exists(), r.output
    assert r.output.splitlines()[-1] == (
        "error: calibration is too noisy to trust (noisy: D2H pinned 16 MiB faster than 4 MiB); no profile written, "
        f"the measurements are in {raw}: rerun cmoe calibrate on a quiet machine, or without --strict")
    assert "Traceback" not in r.output
    r = CliRunner().invoke(app, ["calibrate", "--refit", str(raw), "--out", str(out)])
    assert r.exit_code == 0 and out.is_file(), r.output
    assert ("warning: calibration noisy: D2H pinned 16 MiB faster than 4 MiB: the machine was busy and the profile "
            "may be off; rerun cmoe calibrate on a quiet machine (--strict refuses such a profile)") in r.output.splitlines()
    h2d_64k = next(x for x in r.output.splitlines() if x.startswith("H2D pinned 64 KiB"))
    assert h2d_64k.endswith("   0.5%")           # the spread column: the IQR of two repeats is half their range


def test_per_layer_sums_a_step_and_is_zero_where_the_engine_has_none():
    """The host's time of an op per decode pass, less layer 0's start-up; a run whose engine never
    shows the op (the lean engine's early router inside a graph) costs 0, not NaN."""
    from types import SimpleNamespace
    from cmoe.calibrate.spans import _per_layer
    from cmoe.core.timeline import Span
    spans = [Span("gpu", 0, 0, "host", "host_route", -1, 0.0, 50.0),          # prefill: left out
             Span("gpu", 1, 0, "host", "host_route", -1, 0.0, 30.0),
             Span("gpu", 1, 1, "host", "host_route", -1, 40.0, 50.0),
             Span("gpu", 1, 2, "host", "host_route", -1, 60.0, 70.0),
             Span("gpu", 2, 0, "host", "host_route", -1, 0.0, 10.0),
             Span("gpu", 2, 1, "host", "host_route", -1, 20.0, 34.0),
             Span("gpu", 2, 2, "host", "host_route", -1, 40.0, 46.0)]
    log = SimpleNamespace(spans=spans, pass_us=[(0, False, 0.0, 0.0), (1, True, 0.0, 0.0), (2, True, 0.0, 0.0)])
    # pass 1: layer 0 is 20 over the others' mean of 10; pass 2: layer 0 at 10 is under their 10
    assert _per_layer(log, ("host_route",), 0) == (pytest.approx((30.0 + 30.0) / 2), pytest.approx(10.0))
    assert _per_layer(log, ("host_route",), None) == (pytest.approx(40.0), 0.0)
    assert _per_layer(log, ("host_predict",), None) == (0.0, 0.0)


def test_a_cpus_loads_in_the_model_price_its_link():
    """On a CPU each load is the host's synchronous copy of an expert the caches no longer hold:
    calibrate's ondemand decode loads (the prefill's and empty ones left out) give their mean, and
    the profile's whole H2D curve moves so that a load of that size takes it; a GPU's profile, and a
    CPU's with loads of two sizes, keep the curve."""
    from types import SimpleNamespace

    from cmoe.calibrate.spans import load_copies
    from cmoe.core.timeline import Span
    b = 52_224
    spans = [Span("cpu", 0, 0, "copy0", "load", 1, 0.0, 40.0, b),           # prefill: left out
             Span("cpu", 1, 0, "copy0", "load", 1, 100.0, 112.0, b),
             Span("cpu", 1, 1, "copy0", "load", 2, 200.0, 215.0, b),
             Span("cpu", 2, 0, "copy0", "load", 3, 300.0, 310.0, b),
             Span("cpu", 2, 0, "copy0", "load", 4, 320.0, 320.0, 0),        # nothing moved: left out
             Span("cpu", 2, 0, "compute", "expert", 3, 310.0, 400.0, 0)]
    log = SimpleNamespace(spans=spans, pass_us=[(0, False, 0.0, 0.0), (1, True, 0.0, 0.0), (2, True, 0.0, 0.0)])
    got = load_copies(log)
    assert got == [b, pytest.approx(37.0 / 3 / 1e6), 3]
    mixed = spans[:3] + [Span("cpu", 2, 0, "copy0", "load", 3, 300.0, 310.0, 2 * b)]
    assert load_copies(SimpleNamespace(spans=mixed, pass_us=log.pass_us)) is None
    known = replace(H200, h2d_pinned=_link(18.0, 55.0), d2h_pinned=_link(22.0, 54.0))
    m = _synthetic(known)
    plain = fit_profile("fit", m, known.gpu_mem_bytes, "cpu", "2026-12-07")
    m["layer"]["load_copy"] = got
    cpu = fit_profile("fit", m, known.gpu_mem_bytes, "cpu", "2026-12-07")
    gpu = fit_profile("fit", m, known.gpu_mem_bytes, "test", "2026-12-07")
    assert cpu.h2d_us(b) == pytest.approx(37.0 / 3) and cpu.h2d_queued(b) == pytest.approx(37.0 / 3)
    k = plain.h2d_us(b) / (37.0 / 3)
    assert [g for _, g in cpu.h2d_pinned] == pytest.approx([g * k for _, g in plain.h2d_pinned])
    assert f"x{k:.4f}: as fast as ondemand's 51 KiB expert loads ran in the model" in cpu.sources["h2d_pinned"]
    assert gpu.h2d_pinned == plain.h2d_pinned and "in the model" not in gpu.sources["h2d_pinned"]
    row = next(r for r in beside(cpu, m).splitlines() if r.startswith("load in the model 51 KiB"))
    assert row.split()[6:8] == [f"{37.0 / 3:.1f}us"] * 2                    # measured, fitted
    assert beside(cpu, m).splitlines()[-1] == f"(H2D pinned fitted: the copies' curve x{1 / k:.2f} in time, as the loads in the model took)"
    assert not beside(gpu, m).splitlines()[-1].startswith("(H2D")


def test_queued_loads_give_the_copy_cost_without_start_up():
    """Calibrate's ondemand run: loads that start within 3 us of the last one's end were queued
    behind it; each costs (its end - the last one's end), here 66.4 us for 3,342,336 bytes; a load
    after an idle engine and a prefill's load are left out. The fit takes the bytes at the curve's
    last rate (54.9 GB/s: 60.88 us) off it."""
    from types import SimpleNamespace

    from cmoe.calibrate.link_fit import queued_fit
    from cmoe.calibrate.spans import queued_period
    from cmoe.core.timeline import Span
    b = 3_342_336
    spans = [Span("gpu", 0, 0, "copy0", "load", 1, 0.0, 64.0, b),          # prefill: left out
             Span("gpu", 1, 0, "copy0", "load", 1, 100.0, 165.0, b),
             Span("gpu", 1, 0, "copy0", "load", 2, 166.4, 231.4, b),        # queued: 231.4 - 165.0
             Span("gpu", 1, 1, "copy0", "load", 3, 232.9, 300.0, b),        # queued: 300.0 - 231.4
             Span("gpu", 1, 2, "copy0", "load", 4, 400.0, 472.0, b),        # after 100 us idle
             Span("gpu", 1, 2, "compute", "expert", 4, 472.0, 480.0, 0)]
    log = SimpleNamespace(spans=spans, pass_us=[(0, False, 0.0, 0.0), (1, True, 0.0, 0.0)])
    got = queued_period(log)
    assert got[0] == b and got[2] == 2 and got[1] == pytest.approx((66.4 + 68.6) / 2 / 1e6)
    assert queued_period(SimpleNamespace(spans=spans[:2] + spans[4:], pass_us=log.pass_us)) is None
    h2d = ((1 << 20, 30.7), (1 << 28, 54.9))
    same, fit, k = queued_fit(got, h2d)
    assert same == h2d and k == 1.0 and fit["h2d_queued_us"] == pytest.approx(67.5 - b / 54.9e3)
    assert queued_fit(None, h2d) == (h2d, {}, 1.0)
    assert queued_fit([b, 50e-6, 4], h2d) == (h2d, {"h2d_queued_us": 0.0}, 1.0)   # faster, small: no start-up
    assert queued_fit([b, 0.0, 4], h2d) == (h2d, {}, 1.0) == queued_fit([b, -1e-6, 4], h2d)   # not a time
    # expert-sized loads (93.6 MB) around the curve's last rate: a profile with the fit prices a
    # queued load at what they took, faster (the line moved, its small copy kept) or slower (start-up,
    # up to the curve's own time at their size: 3.4% over the last rate here)
    big, h2d = 93_585_408, ((1 << 20, 30.7), (1 << 24, 50.2), (1 << 28, 54.9))
    at_last = big / 54.9e9
    own = big / (H200.curve_gbps(h2d, big) * 1e9)
    for f in (0.97, 0.999, 1 - 1e-9, 1.0, 1 + 1e-9, 1.001, 1.01):
        curve_, fit, k = queued_fit([big, at_last * f, 112], h2d)
        prof = replace(H200, h2d_pinned=curve_, **fit)
        assert prof.h2d_queued(big) == pytest.approx(at_last * f * 1e6, rel=1e-9), f
        assert curve_[0] == h2d[0] and (k > 1) == (f <= 1) and (curve_ == h2d) == (f > 1)
        if f <= 1:
            assert fit == {"h2d_queued_us": 0.0}
            assert [g for _, g in curve_[1:]] == pytest.approx([g * k for _, g in h2d[1:]])
    curve_, fit, _ = queued_fit([big, own * 1.05, 112], h2d)                  # slower than the curve itself
    assert replace(H200, h2d_pinned=curve_, **fit).h2d_queued(big) == pytest.approx(own * 1e6)
    small = ((1 << 20, 30.7), (1 << 23, 48.0))                                # no point of the line to move
    assert queued_fit([big, big / 60e9, 112], small) == (small, {"h2d_queued_us": 0.0}, 1.0)


def test_fused_launch_fit_recovers_its_parameters():
    """upper's fused launches (experts, rows, seconds, bytes) made from known parameters: the fit
    gives them back; a launch whose rows cost nothing keeps wave_row_us at 0 rather than below;
    one expert count alone cannot separate the launch's fixed cost, so no wave model is fitted."""
    from cmoe.calibrate.profile_fit import _wave_fit
    nbytes = 93_585_408
    a, c, b = nbytes / (3200e9), 25e-6, 0.4e-6                 # 3,200 GB/s, 25 us, 0.4 us per row
    pts = [[n, r, c + a * n + b * r, nbytes] for n, r in ((2, 2), (3, 4), (4, 8), (5, 8), (7, 16), (8, 32))]
    got = _wave_fit(pts)
    assert got["wave_gbps"] == pytest.approx(3200.0, rel=1e-9)
    assert got["wave_us"] == pytest.approx(25.0, rel=1e-9) and got["wave_row_us"] == pytest.approx(0.4, rel=1e-9)
    assert [n for n, _ in got["wave_count_us"]] == [2, 3, 4, 5, 7, 8]
    assert all(us == pytest.approx(25.0, rel=1e-6) for _, us in got["wave_count_us"])   # a straight line: c each
    # a bent launch (three experts 8 us slower than the line): with one launch per count the table
    # gives every launch back exactly beside the fitted shares
    bent_pts = [[n, r, t + (8e-6 if n == 3 else 0.0), nb] for n, r, t, nb in pts]
    bent = _wave_fit(bent_pts)
    for n, r, t, nb in bent_pts:
        share = n * nb / (bent["wave_gbps"] * 1e9) * 1e6 + bent["wave_row_us"] * r
        assert dict(bent["wave_count_us"])[n] + share == pytest.approx(t * 1e6, rel=1e-9)
    flat = _wave_fit([[n, r, c + a * n - 1e-9 * r, nbytes] for n, r, *_ in pts])
    assert flat["wave_row_us"] == 0.0 and flat["wave_gbps"] == pytest.approx(3200.0, rel=1e-3)
    assert _wave_fit([[2, 2, 80e-6, nbytes]] * 5) == {}


def test_owa_fit_is_commits_excess_over_uppers_launch():
    """`owa_gpu_us`: commit's launches (OWA on the device) against upper's fit of the same
    launches, their mean excess; nothing without a wave fit or commit points, never below 0."""
    from cmoe.calibrate.profile_fit import _owa_fit
    nbytes = 93_585_408
    waves = {"wave_gbps": 3200.0, "wave_us": 25.0, "wave_row_us": 0.5, "wave_count_us": ((2, 25.0), (3, 25.0))}
    fit = lambda n, r: 25e-6 + n * nbytes / 3200e9 + 0.5e-6 * r    # noqa: E731
    pts = [[2, 2, fit(2, 2) + 40e-6, nbytes], [2, 2, fit(2, 2) + 50e-6, nbytes], [3, 3, fit(3, 3) + 60e-6, nbytes]]
    assert _owa_fit(pts, waves)["owa_gpu_us"] == pytest.approx(50.0, rel=1e-9)
    assert _owa_fit(pts, {}) == {} and _owa_fit([], waves) == {}
    assert _owa_fit([[2, 2, fit(2, 2) - 5e-6, nbytes]], waves) == {"owa_gpu_us": 0.0}


def test_gaps_price_the_read_back_not_the_gpu_work_the_host_waited_behind():
    """The host_sync span of an eager step also holds the GPU work queued before the read-back;
    the simulator's host_sync_us is the latency after it: the GPU's idle gap between a layer's
    attention and its first expert, less the host's route and launch spans, which the simulator
    adds after it (the launch less its tail, so the tail is added back)."""
    from types import SimpleNamespace
    from cmoe.calibrate.spans import _gaps, _sync_s
    from cmoe.core.timeline import Span
    spans = [Span("gpu", 1, 0, "compute", "attention", -1, 0.0, 100.0),
             Span("gpu", 1, 0, "host", "host_sync", -1, 10.0, 130.0),       # waited behind 90 us of GPU work
             Span("gpu", 1, 0, "host", "host_route", -1, 130.0, 150.0),
             Span("gpu", 1, 0, "host", "host_expert", -1, 150.0, 155.0),
             Span("gpu", 1, 0, "compute", "expert", 3, 160.0, 200.0),
             Span("gpu", 1, 0, "compute", "expert", 5, 200.0, 240.0)]
    log = SimpleNamespace(spans=spans, pass_us=[(1, True, 0.0, 0.0)])
    assert _gaps(log) == [pytest.approx(35e-6)]                  # 60 us idle: 20 the route, 5 the launch
    host = {"gaps": _gaps(log) * 3, "sync": [120e-6]}
    assert _sync_s(host, [(1, 3e-6), (8, 5e-6)]) == pytest.approx(39e-6)          # + the mean tail, 4 us
    assert _sync_s({"gaps": [], "sync": [120e-6, 100e-6, 130e-6]}, []) == pytest.approx(120e-6)


def test_pass_overhead_of_a_lean_upper_run():
    """Between two decode passes the GPU idles while the host turns logits into the next inputs;
    that gap plus layer 0's start-up excess is the host's per pass; the head is its own span."""
    from types import SimpleNamespace
    from cmoe.calibrate.spans import _pass_overhead
    from cmoe.core.timeline import Span

    def one_pass(p, t0):
        return [Span("gpu", p, 0, "compute", "attention", -1, t0, t0 + 300.0),      # 240 over the others
                Span("gpu", p, 0, "compute", "expert", 1, t0 + 300.0, t0 + 380.0),
                Span("gpu", p, 1, "compute", "attention", -1, t0 + 380.0, t0 + 440.0),
                Span("gpu", p, 1, "compute", "expert", 2, t0 + 440.0, t0 + 520.0),
                Span("gpu", p, -1, "compute", "head", -1, t0 + 520.0, t0 + 700.0)]
    log = SimpleNamespace(spans=one_pass(1, 0.0) + one_pass(2, 900.0) + one_pass(3, 1800.0),
                          pass_us=[(1, True, 0, 0.0), (2, True, 0, 0.0), (3, True, 0, 0.0)])
    host, start, head = _pass_overhead(log, 0)
    assert (host, start, head) == (pytest.approx(440e-6), pytest.approx(240e-6), pytest.approx(180e-6))


def test_host_between_passes_of_runs_that_read_back():
    """Queued decode passes (`pass_overlap`): the host's pass start is its own lane's gap from one
    pass's head to the next pass's first layer, plus layer 0's excess over the other layers."""
    from types import SimpleNamespace
    from cmoe.calibrate.spans import _host_between
    from cmoe.core.timeline import Span

    def one_pass(p, t0, gap):
        return [Span("gpu", p, 0, "host", "host_attention", -1, t0 + gap, t0 + gap + 50.0),   # 30 over layer 1
                Span("gpu", p, 0, "host", "host_sync", -1, t0 + gap + 50.0, t0 + gap + 200.0),
                Span("gpu", p, 1, "host", "host_attention", -1, t0 + gap + 300.0, t0 + gap + 320.0),
                Span("gpu", p, -1, "host", "host_head", -1, t0 + gap + 400.0, t0 + gap + 410.0)]
    # heads end at 410, 1510, 2610; the next passes' first layers enter at 1000 + 100, 2000 + 300
    log = SimpleNamespace(spans=one_pass(1, 0.0, 0.0) + one_pass(2, 1000.0, 100.0) + one_pass(3, 2000.0, 300.0),
                          pass_us=[(0, False, 0, 0.0), (1, True, 0, 0.0), (2, True, 0, 0.0), (3, True, 0, 0.0)])
    gaps = [(1000.0 + 100.0) - 410.0, (2000.0 + 300.0) - (1000.0 + 100.0 + 410.0)]
    assert _host_between(log, 0) == pytest.approx((sum(gaps) / 2 + 30.0) / 1e6)


def test_the_lean_engines_gpu_side_steps_run_on_the_cpu(checkpoints, monkeypatch):
    """The steps calibrate takes only for the lean engine on CUDA (`_ModelRuns.lean`: upper's own
    run for the GPU side, the read-back's and the prediction's cost inside A_m, the fused launches,
    the pass's overhead), forced on a CPU run: same logic, so a step that cannot run shows here."""
    import torch

    from cmoe.calibrate import host_runs
    from cmoe.calibrate import measure_model as mm
    from cmoe.core.checkpoint import check_checkpoint
    import os

    from cmoe.executor import run
    monkeypatch.setattr(mm._ModelRuns, "lean", property(lambda self: self.w is not None and self.w.store is not None))
    monkeypatch.delenv("CMOE_HOST_PROGRAM", raising=False)
    seen, real = [], run.run_policy
    slots, lp_runs = [], []
    monkeypatch.setattr(run, "run_policy", lambda w, c, p, *a, **k: seen.append((p, os.environ.get("CMOE_HOST_PROGRAM")))
                        or (p == "oracle" and slots.append(c.slots)) or (p == "lru-prefetch" and lp_runs.append((p, c)))
                        or real(w, c, p, *a, **k))
    # a launch's extra beside a load (`copy_launch_us`): lru-prefetch's loading runs at batch 1 and 8, three
    # quarters of the slots, their points kept in that order (a CPU's host copies overlap nothing: stand-ins)
    points = []
    monkeypatch.setattr(mm, "launch_copy_points", lambda log, first, batch: points.append(
        (batch, len({sp[1] for sp in log.spans}))) or [[batch, 2, 1e-4, 1.1e-4, 5, 5]])
    d = checkpoints["mixtral"]
    spec = check_checkpoint(d)
    out = mm.layers(torch.device("cpu"), spec, "fp32", 2, d, tokens=4)
    lay = out["layer"]
    # a CPU's loads as the host copied them in calibrate's ondemand run (`copied_fit`); no copy stream queues
    assert lay["load_copy"][0] > 0 and lay["load_copy"][1] > 0 and lay["load_copy"][2] > 0 and "load_queue" not in lay
    assert [b for b, _ in points] == [1, 8] and all(n > 1 for _, n in points)
    assert lay["launch_copy_points"] == [[1, 2, 1e-4, 1.1e-4, 5, 5], [8, 2, 1e-4, 1.1e-4, 5, 5]]
    three_quarters = 3 * spec.num_experts // 4
    assert [(c.batch, c.tokens) for _, c in lp_runs if c.slots == three_quarters] == [(1, 4), (8, 4), (8, 4)]
    # one oracle run at batch 1, all the slots but one (`start_copy_us`); measured only where both sides had passes
    assert slots == [spec.num_experts - 1] and lay.get("start_copy_s", 0.0) >= 0.0
    # the Python step's host (`_python_step`): three ondemand runs a batch a round with the program off, two kept
    assert [x for x in seen if x[1] is not None] == [("ondemand", "0")] * 3 * 2 * HOST_ROUNDS
    assert "CMOE_HOST_PROGRAM" not in os.environ
    assert [[b, len(v)] for b, v in out["repeats"]["Py step, route"]["points"]] == [[1, 2 * HOST_ROUNDS], [8, 2 * HOST_ROUNDS]]
    assert out["repeats"]["Py step, expert"]["judged"] is False
    py = lay["host_python"]
    assert [b for b, _ in py["layer_points"]] == [b for b, _ in py["route_points"]] == [1, 8]
    assert py["pass_start_s"] is None and py["sync_s"] >= 0.0 and py["head_s"] > 0.0   # passes not queued on a CPU
    from cmoe.calibrate.host_fit import python_host
    assert [b for b, _ in python_host(lay)["host_route_points"]] == [1, 8]
    assert lay["readback_gpu_s"] >= 0.0 and lay["predict_gpu_s"] >= 0.0
    assert lay["host"]["pass_gap_s"] == pytest.approx(lay["host"]["pass_start_s"] - lay["pass_start_s"])
    # queued decode passes: the host's pass start is the runs that read back's (`_host_between`, here
    # a stand-in value), the gap still upper's
    monkeypatch.setattr(mm._ModelRuns, "queued", property(lambda self: True))
    monkeypatch.setattr(host_runs, "_host_between", lambda log, first: 0.00123)
    q = mm.layers(torch.device("cpu"), check_checkpoint(d), "fp32", 2, d, tokens=4)["layer"]
    assert q["host"]["pass_start_s"] == pytest.approx(0.00123) and q["host"]["pass_gap_s"] < 0.00123
    assert lay["commit_gpu_s"] >= 0.0 and lay["commit_gpu_copy_s"] >= 0.0
    # a difference of two runs' layer-0 excesses: either sign is possible, the fit clamps it at 0
    assert isinstance(lay["commit_start_excess_s"], float) and abs(lay["commit_start_excess_s"]) < 1.0
    assert len(out["waves"]) > 0 and all(len(w) == 4 for w in out["waves"])
    assert len(out["commit_waves"]) > 0 and all(len(w) == 4 for w in out["commit_waves"])
    assert lay["points"] == [pt for pt in lay["points"] if pt[1] > 0] and len(lay["points"]) == 2   # batches 1, 8
    assert set(out["seconds"]) >= {"batch 1", "batch 8", "long context"}
    laps = {k: v for k, v in out["seconds"].items() if ": " in k}      # batch 1's runs, each timed (on a CPU)
    assert sorted(laps) == ["batch 1: commit, loading", "batch 1: commit, resident", "batch 1: lru-prefetch, loading",
                            "batch 1: lru-prefetch, resident", "batch 1: ondemand, loading", "batch 1: oracle",
                            "batch 1: static runs", "batch 1: upper and ondemand runs", "batch 8: static runs"]
    assert sum(v for k, v in laps.items() if k.startswith("batch 1")) <= out["seconds"]["batch 1"]
    # a short and a long prompt's layer, each the median of its runs (taking turns on a CPU), which
    # are shown with their spread, not judged
    ctx = out["repeats"]["layer, context"]
    assert ctx["judged"] is False and [len(v) for _, v in ctx["points"]] == [mm.CONTEXT_RUNS] * 2 == [3, 3]
    assert lay["context_points"] == [(k, pytest.approx(sorted(v)[1])) for k, v in ctx["points"]]
    assert [k for k, _ in ctx["points"]] == [20.5, mm.LONG_PROMPT // 8 + 4.5]



def test_host_pass_start_is_the_median_of_every_runs(checkpoints, monkeypatch):
    """Queued decode passes: each eager run's host pass start (`_host_between`) is kept per batch
    under `repeats` ("host, pass start", shown, not judged), and the profile's is the median over
    every batch's runs of every round, so one disturbed run (or one early pair, as on the H100 in the
    twenty-second session: 414 us, where the runs measured 285-303) does not set it."""
    import torch

    from cmoe.calibrate import host_runs
    from cmoe.calibrate import measure_model as mm
    from cmoe.core.checkpoint import check_checkpoint
    monkeypatch.setattr(mm._ModelRuns, "queued", property(lambda self: True))
    seq = iter([1e-3, 2e-3, 5e-3, 6e-3, 3e-3, 0.1, 7e-3, 8e-3])   # batch 1, 8 (round 1); 1, 8 (round 2)
    monkeypatch.setattr(host_runs, "_host_between", lambda log, first: next(seq))
    d = checkpoints["mixtral"]
    out = mm.layers(torch.device("cpu"), check_checkpoint(d), "fp32", 2, d, tokens=4)
    assert out["repeats"]["host, pass start"]["points"] == [[1, [1e-3, 2e-3, 3e-3, 0.1]], [8, [5e-3, 6e-3, 7e-3, 8e-3]]]
    assert out["repeats"]["host, pass start"]["judged"] is False
    assert out["layer"]["host"]["pass_start_s"] == pytest.approx(5.5e-3)        # median of all eight
    heads = out["repeats"]["host, LM head"]["points"]                  # the LM head: batch 1's runs, their median
    assert [b for b, _ in heads] == [1, 8] and len(heads[0][1]) == 2 * mm.HOST_ROUNDS
    assert out["layer"]["host"]["head_s"] == pytest.approx(float(np.median(heads[0][1])))
    assert next(seq, None) is None                                # two runs a batch a round, nothing else
    # on a CPU the compute lane is the host's: its layer and head are every round's runs' means (`cpu_lanes`)
    lay = out["layer"]
    assert lay["points"] == [(b, pytest.approx(float(np.mean(v)))) for b, v in out["repeats"]["host, layer"]["points"]]
    assert lay["head_s"] == pytest.approx(float(np.mean(heads[0][1])))

def test_a_cpus_compute_lane_is_every_rounds_runs():
    """`cpu_lanes`: on a CPU the compute lane's layer points, experts in the model, pass start and
    LM head are the host's own over every round's runs (their means), no longer the first run's."""
    from types import SimpleNamespace

    from cmoe.calibrate.host_runs import cpu_lanes
    runs = [{"start": s, "head": h} for s, h in ((100.0, 2e-4), (300.0, 4e-4), (200.0, 6e-4), (600.0, 8e-4))]
    r = SimpleNamespace(gpu={"points": [(1, 9.0), (8, 9.0)], "expert": [(1, 9.0), (8, 9.0)]},
                        host={"layer": [(1, 3.0), (8, 6.0)], "expert_span": [(1, 5.0), (8, 2.0)]},
                        host_runs={1: runs, 8: runs[:1]}, one={"gpu_start": 9.0, "gpu_head": 9.0})
    cpu_lanes(r)
    assert r.gpu == {"points": [(1, 3.0), (8, 6.0)], "expert": [(1, 5.0), (8, 2.0)]}
    assert r.one == {"gpu_start": pytest.approx(300e-6), "gpu_head": pytest.approx(5e-4)}


def test_host_points_are_means_over_every_rounds_runs():
    """The host's table takes each batch's mean over all its rounds' runs, keeps each run's figure
    under `repeats`, pools the read-back waits and gaps of all of them, and keeps each batch's mean
    wait (what its route step followed: `host_wake_base`)."""
    from types import SimpleNamespace

    from cmoe.calibrate.host_runs import _host_points

    def run(layer, route, expert, span, sync, gaps):
        return {"layer": layer, "start": 0.0, "route": route, "expert": expert, "expert_span": span,
                "sync": sync, "gaps": gaps}
    host = {k: [] for k in ("layer", "route", "expert", "expert_span", "sync", "waits", "layer_runs", "route_runs",
                            "expert_runs", "gaps")}
    r = SimpleNamespace(host=host, host_runs={
        1: [run(1.0, 10.0, 100.0, 5.0, 0.5, [1.0]), run(3.0, 30.0, 300.0, 7.0, 1.5, []),     # round 1
            run(2.0, 20.0, 200.0, 6.0, 1.0, [2.0, 3.0]), run(6.0, 60.0, 600.0, 2.0, 2.0, [])],  # round 2
        8: [run(4.0, 8.0, 16.0, 1.0, 0.25, [])] * 2 + [run(8.0, 16.0, 32.0, 3.0, 0.75, [4.0])] * 2})
    _host_points(r, (1, 8))
    assert host["layer"] == [(1, 3.0), (8, 6.0)]
    assert host["route"] == [(1, 30.0), (8, 12.0)]
    assert host["expert"] == [(1, 300.0), (8, 24.0)]
    assert host["expert_span"] == [(1, 5.0), (8, 2.0)]
    assert host["layer_runs"] == [[1, [1.0, 3.0, 2.0, 6.0]], [8, [4.0, 4.0, 8.0, 8.0]]]
    assert host["route_runs"][1] == [8, [8.0, 8.0, 16.0, 16.0]]
    assert host["sync"] == [0.5, 1.5, 1.0, 2.0, 0.25, 0.25, 0.75, 0.75]
    assert host["waits"] == [(1, 1.25), (8, 0.5)]            # the wait each batch's route point followed
    assert host["gaps"] == [1.0, 2.0, 3.0, 4.0, 4.0]


def test_copy_slowdown_times_each_kernel_alone_then_beside_the_copy_in_pairs():
    """A round: sync, the kernel alone, the copy queued, the kernel again with no sync between (a
    device-wide sync there waits for the copy: the bug that made the old figure the matmul's drift),
    then sync; every other round the busy side first; the slowdowns are the rounds' own ratios."""
    from cmoe.calibrate.measure import paired_slowdowns
    log, times = [], iter([100.0, 110.0, 200.0, 204.0, 50.0, 50.0])

    def timed():
        log.append("timed")
        return next(times)
    out = paired_slowdowns(timed, lambda: log.append("copy"), lambda: log.append("sync"), 3)
    assert log == (["sync", "timed", "copy", "timed", "sync"] + ["sync", "copy", "timed", "sync", "timed", "sync"]
                   + ["sync", "timed", "copy", "timed", "sync"])
    assert out == pytest.approx([0.10, 200.0 / 204.0 - 1.0, 0.0])   # round 2 timed busy (200) before alone (204)


def test_the_host_around_a_layers_cpu_experts_is_read_off_its_spans():
    """`log_points._cpu_steps`: per decode layer with CPU experts, its last launch's issue to the
    first expert, the gaps between experts, the results' return to the next layer's start (in the
    same pass), and per pair of decode passes the host's pass start; the prefill and layers without
    CPU experts give nothing."""
    from types import SimpleNamespace as NS
    from cmoe.calibrate.log_points import _cpu_steps, cpu_in_model
    from cmoe.core.timeline import Span
    S = lambda p, d, stream, op, a, b, e=-1: Span("gpu", p, d, stream, op, e, a, b, 0)  # noqa: E731
    spans = [S(0, 1, "cpu", "cpu_expert", 0.0, 9.0, 3),                                # prefill: left out
             S(1, 1, "host", "host_expert", 100.0, 110.0), S(1, 1, "host", "host_expert", 112.0, 120.0),
             S(1, 1, "cpu", "roundtrip", 90.0, 95.0), S(1, 1, "cpu", "cpu_expert", 190.0, 1190.0, 4),
             S(1, 1, "cpu", "cpu_expert", 1215.0, 2215.0, 5), S(1, 1, "cpu", "roundtrip", 2215.0, 2265.0),
             S(1, 3, "host", "host_attention", 2315.0, 2320.0), S(1, 3, "host", "host_expert", 2400.0, 2410.0),
             S(1, 3, "cpu", "cpu_expert", 2480.0, 3480.0, 1), S(1, 3, "cpu", "roundtrip", 3480.0, 3540.0),
             S(1, -1, "host", "host_head", 3600.0, 3620.0),
             S(2, 1, "host", "host_attention", 9000.0, 9010.0),                        # the next pass: no tail
             S(2, 3, "host", "host_attention", 9100.0, 9104.0)]
    log = NS(spans=spans, pass_us=[(0, False, 64, 1.0), (1, True, 3, 1.0), (2, True, 2, 1.0)])
    got = _cpu_steps(log)
    # the pass start: pass 1's head issued at 3620, pass 2 entered at 9000, its first layer 6 us
    # over the others' (10 against 4); pass 1 ran CPU experts in 2 layers, pass 2 has 2 rows
    assert got == {"lead": pytest.approx([70e-6, 70e-6]), "gap": pytest.approx([25e-6]),
                   "tail": pytest.approx([50e-6]), "pass_points": [[2, 2, pytest.approx(5386e-6),
                                                                    pytest.approx(5380e-6)]]}
    # the profile's pass start and gap are the points' means (`cpu_in_model`)
    step = cpu_in_model([], [], got)["cpu_step"]
    assert list(step) == ["lead", "gap", "tail", "pass_start", "pass_gap"]
    assert (step["pass_start"], step["pass_gap"]) == (pytest.approx(5386e-6), pytest.approx(5380e-6))
    # synced passes (no `pass_overlap`): the gap would hold the wait for the head; no pass start read
    assert set(_cpu_steps(log, passes=False)) == {"lead", "gap", "tail"}


def test_a_cpu_experts_wake_after_idle_is_fitted_over_the_back_to_back_ones():
    """`cpu_fit.cpu_expert_fit`: the base line from the experts that followed another within 0.1 ms,
    each idle bin's extra its experts' time over that base; `log_points.cpu_in_model` bins them."""
    from cmoe.calibrate.log_points import cpu_in_model
    known = replace(H200, cpu_expert_gbps=60.0, cpu_expert_us_per_token=400.0,
                    cpu_wake_points=((25.0, 0.0), (600.0, 300.0), (5000.0, 500.0)))
    nb = 93_585_408
    pts = [(t, (known.cpu_expert_us(nb, t) + known.cpu_wake_us(idle)) / 1e6, idle / 1e6)
           for t in (1, 2) for idle in (25.0, 600.0, 5000.0) for _ in range(6)]
    pts.append((1, 9.9e-3, float("inf")))                            # the run's first: its points, no idle bin
    got = cpu_in_model(pts, [(1, 1e-4), (1, 2e-4), (8, 3e-4)], {"lead": [7e-5], "gap": []})
    assert [r[:2] + [r[4]] for r in got["cpu_expert_in_model"]["idle"]] == \
        [[1, 0.0, 6], [1, 300.0, 6], [1, 3000.0, 6], [2, 0.0, 6], [2, 300.0, 6], [2, 3000.0, 6]]
    assert got["cpu_expert_in_model"]["count"] == [(1, 19), (2, 18)]
    assert got["roundtrip_in_model"] == pytest.approx(2e-4) and got["cpu_step"] == {"lead": pytest.approx(7e-5)}
    assert got["cpu_pass_points"] == []
    assert got["roundtrip_points"] == [(1, pytest.approx(1.5e-4)), (8, pytest.approx(3e-4))]
    m = _synthetic(known) | got
    p = fit_profile("fit", m, known.gpu_mem_bytes, "test", "2026-12-06")
    assert p.cpu_expert_us(nb, 1) == pytest.approx(known.cpu_expert_us(nb, 1))
    assert p.cpu_expert_us_per_token == pytest.approx(400.0)
    assert [v for pt in p.cpu_wake_points for v in pt] == pytest.approx([25.0, 0.0, 600.0, 300.0, 5000.0, 500.0],
                                                                        abs=1e-6)
    assert "idle" in p.sources["cpu_wake_points"] and "CPU expert 1 tok, 600us idle" in beside(p, m)
    assert p.roundtrip_points == ((1, pytest.approx(150.0)), (8, pytest.approx(300.0)))
    assert p.roundtrip(4) == pytest.approx(150.0 + 150.0 * 3 / 7) and "round trip in model, 8 rows" in beside(p, m)
    m["cpu_expert_in_model"]["idle"] = [r for r in m["cpu_expert_in_model"]["idle"] if r[1] == 0.0]
    one = fit_profile("fit", m, known.gpu_mem_bytes, "t", "d")            # one bin: no extras, and
    assert one.cpu_wake_points == ()                                      # every expert's mean, not the
    pooled = fit_profile("fit", _synthetic(known), known.gpu_mem_bytes, "t", "d")    # back-to-back ones'
    assert one.cpu_expert_us(nb, 1) > known.cpu_expert_us(nb, 1) and pooled.cpu_expert_us(nb, 1) == \
        pytest.approx(known.cpu_expert_us(nb, 1))


def test_each_cpu_experts_idle_is_read_after_the_one_before_it_ended():
    """`log_points._cpu_points`: the spans in start order, whatever their order in the log; the
    prefill's experts count as the ones before (their own points are left out); the run's first
    expert follows none (inf); tokens from the trace's votes."""
    from types import SimpleNamespace as NS
    from cmoe.calibrate.log_points import _cpu_points
    from cmoe.core.timeline import Span
    from cmoe.core.quant import recipe
    from cmoe.core.spec import preset
    from cmoe.trace.passes import make_passes
    from cmoe.trace.synthetic import SyntheticParams, generate
    t = generate(preset("mixtral-8x7b"), recipe("w4a16"), SyntheticParams(requests=1, prompt_len=4, decode_len=4))
    ps = make_passes(t, 1)
    d0, d1 = preset("mixtral-8x7b").moe_layers[:2]
    e0, e1 = int(ps[1].needed[0][0]), int(ps[1].needed[1][0])
    S = lambda p, d, e, a, b: Span("gpu", p, d, "cpu", "cpu_expert", e, a, b, 0)  # noqa: E731
    spans = [S(1, d1, e1, 5000.0, 6000.0), S(1, d0, e0, 1500.0, 3000.0), S(0, d0, e0, 0.0, 1000.0)]
    pts, _ = _cpu_points(NS(spans=spans, pass_us=[(0, False, 4, 1.0), (1, True, 1, 1.0)]), t, 1, preset("mixtral-8x7b"))
    assert pts == [(1, pytest.approx(1.5e-3), pytest.approx(5e-4)), (1, pytest.approx(1e-3), pytest.approx(2e-3))]
    first, _ = _cpu_points(NS(spans=spans[:2], pass_us=[(0, False, 4, 1.0), (1, True, 1, 1.0)]), t, 1,
                           preset("mixtral-8x7b"))
    assert first[0][2] == float("inf") and first[1][2] == pytest.approx(2e-3)


def test_a_cpu_experts_time_by_tokens_is_a_table_fitted_with_the_idle_extras():
    """`cpu_fit.cpu_expert_fit`: the time by tokens and each idle bin's extra fitted together, so a
    token count seen only after idle (batch 8's 5-token experts follow a layer's GPU part) keeps
    its own level and does not pull the bin's extra; the kernel's step at 5 tokens is a table's
    point (`cpu_expert_points`), and past the model's token counts the isolated loop's shape
    carries it on (`_extend`)."""
    from cmoe.calibrate.log_points import cpu_in_model
    known = replace(H200, cpu_expert_gbps=60.0, cpu_expert_points=((1, 1.0), (2, 1.25), (3, 1.5), (4, 1.75), (5, 2.75)),
                    cpu_wake_points=((25.0, 0.0), (600.0, 300.0), (5000.0, 500.0)))
    nb = 93_585_408
    one = known.cpu_expert_us(nb, 1)
    cells = [(t, idle) for t in (1, 2, 3, 4) for idle in (25.0, 600.0)] + [(5, 600.0), (1, 5000.0)]
    pts = [(t, (known.cpu_expert_us(nb, t) + known.cpu_wake_us(idle)) / 1e6, idle / 1e6) for t, idle in cells
           for _ in range(6)]
    m = _synthetic(known) | cpu_in_model(pts, [(1, 1e-4)], {}, [[1, "dense", 1.5e-3, 40], [8, "dense", 1.2e-3, 9]])
    m["cpu_expert"] = {"bytes": nb, "points": [(1, 1e-3), (4, 2e-3), (8, 3e-3)]}      # isolated: its shape only
    p = fit_profile("fit", m, known.gpu_mem_bytes, "test", "2026-12-06")
    assert p.cpu_expert_us(nb, 1) == pytest.approx(one)
    assert [t for t, _ in p.cpu_expert_points] == [1, 2, 3, 4, 5, 8]
    assert [k for _, k in p.cpu_expert_points][:5] == pytest.approx([1.0, 1.25, 1.5, 1.75, 2.75])
    # at 5 tokens the loop reads 2e-3 + 1e-3 / 4 = 2.25e-3; at 8 tokens 3e-3: 2.75 x 3 / 2.25
    assert p.cpu_expert_points[-1][1] == pytest.approx(2.75 * 3e-3 / 2.25e-3)
    assert [v for pt in p.cpu_wake_points for v in pt] == pytest.approx([25.0, 0.0, 600.0, 300.0, 5000.0, 500.0],
                                                                        abs=1e-6)
    assert "tokens" in p.sources["cpu_expert_points"] and "CPU expert in model, 5 tok" in beside(p, m)
    rows = {ln[:28].strip(): ln[28:].split() for ln in beside(p, m).splitlines()}     # each run, as measured
    assert rows["CPU 1 tok, b1 dense run"][:2] == ["1500.0us", f"{one:.1f}us"] and "CPU 1 tok, b8 dense run" in rows
    assert p.cpu_scaled(2.0).cpu_expert_us(nb, 5) == pytest.approx(2 * p.cpu_expert_us(nb, 5))


@pytest.mark.parametrize("cells,why", [
    ([(2, 0.0, 6), (1, 300.0, 6)], "one token only after idle: base(1) and the extra cannot be told apart"),
    ([(6, 0.0, 3), (1, 300.0, 6), (2, 300.0, 6)], "back-to-back experts only at a rare token count"),
])
def test_a_cpu_fit_the_cells_cannot_separate_keeps_every_experts_mean(cells, why):
    """`cpu_fit._joint` gives nothing (the fit falls back to every expert's mean by tokens, no wake
    table) where its terms are not all determined, instead of a minimum-norm split or a division
    by zero."""
    from cmoe.calibrate.cpu_fit import _joint, cpu_expert_fit
    rows = [[t, lo, lo + 25.0, 1.5e-3 * t + (3e-4 if lo else 0.0), n] for t, lo, n in cells]
    assert _joint(rows) == ({}, {}, {}), why
    pts = sorted({t: 1.5e-3 * t for t, _, _ in cells}.items())
    m = {"cpu_expert": {"bytes": 1, "points": [(1, 1e-3), (8, 5e-3)]},
         "cpu_expert_in_model": {"points": pts, "count": [(t, 6) for t, _ in pts], "idle": rows}}
    ca, _, fields = cpu_expert_fit(m)
    assert "cpu_wake_points" not in fields and ca > 0, why


def test_a_bin_seen_only_at_rare_token_counts_is_left_out_of_the_cpu_fit():
    """A bin whose experts all have token counts seen fewer than `LEAST` times has no extra of its
    own (it had divided by zero); the rest fits as usual."""
    from cmoe.calibrate.cpu_fit import _joint
    rows = [[1, 0.0, 25.0, 1.5e-3, 6], [1, 300.0, 400.0, 1.8e-3, 6], [6, 3000.0, 4000.0, 9e-3, 3], [7, 3000.0, 5000.0, 9e-3, 2]]
    base, extra, idle = _joint(rows)
    assert base == {1: pytest.approx(1.5e-3)} and extra == {300.0: pytest.approx(3e-4)}
    assert idle == {0.0: 25.0, 300.0: 400.0}


def test_the_isolated_cpu_loop_cycles_over_experts_past_the_cache(monkeypatch):
    """`measure._cpu_views`: distinct random experts (other seeds, other bytes), twice the last-level
    cache together, 1 to 8 of them."""
    import builtins
    import io
    from cmoe.calibrate.measure import _cpu_views
    from cmoe.executor.layout import expert_layout
    lay = expert_layout("w4g128", 256, 512)
    real = builtins.open

    def fake(path, *a, **k):
        return io.StringIO(f"{3 * lay.nbytes // 1024}K") if "index3/size" in str(path) else real(path, *a, **k)
    monkeypatch.setattr(builtins, "open", fake)
    views = _cpu_views(lay)
    assert len(views) == 6                                      # 2 x 3 expert sizes of cache
    assert not views[0].w13.equal(views[1].w13)
    monkeypatch.setattr(builtins, "open", lambda *a, **k: (_ for _ in ()).throw(OSError("no sysfs")))
    assert len(_cpu_views(lay)) == 8                            # unknown: 64 MiB assumed, capped at 8


def test_a_fitted_profile_keeps_the_openmp_wait_policy_its_cpu_experts_ran_under():
    """`device.omp_wait_policy` (what `cmoe.executor.omp_wait.in_force` recorded as calibrate
    measured) becomes the profile's `omp_wait_policy`; measurements from before it give ""."""
    m = _synthetic(H200)
    assert fit_profile("fit", m, H200.gpu_mem_bytes, "test", "d").omp_wait_policy == ""
    m["device"] = {"label": "test", "omp_wait_policy": "ACTIVE"}
    assert fit_profile("fit", m, H200.gpu_mem_bytes, "test", "d").omp_wait_policy == "ACTIVE"


def test_the_host_counts_cores_from_before_libgomp_binds(monkeypatch):
    """Under a binding libgomp pins the first thread to one core when torch loads it; the host's
    record (`host_cpu`) counts the mask `omp_wait` took at import, before that."""
    from cmoe.calibrate.measure import host_cpu
    from cmoe.executor import omp_wait
    monkeypatch.setattr(omp_wait, "_CORES", 7)
    assert omp_wait.cores() == 7
    assert host_cpu() == "" or host_cpu().endswith(", 7 cores")
    monkeypatch.setattr(omp_wait, "_CORES", None)             # torch came first: the mask now
    assert omp_wait.cores() == len(os.sched_getaffinity(0))


def test_a_profile_for_gpu_only_policies_shows_the_cpu_experts_noise_without_judging_it(tmp_path):
    """`cmoe calibrate --policy` naming GPU-only policies: their runs never use the CPU experts, so
    a spread there (threads that sleep between experts, as those runs' do) is shown, not judged."""
    from typer.testing import CliRunner

    from cmoe.cli.app import app
    raw = _measurements(tmp_path, lambda m: {
        "CPU expert": {"unit": "tokens", "grows": True, "points": [[1, [900.0, 1800.0]], [4, [1500.0]]]}})
    out = tmp_path / "p.json"
    cal = ["calibrate", "--refit", str(raw), "--out", str(out), "--strict"]
    r = CliRunner().invoke(app, cal)
    assert r.exit_code == 2 and not out.exists(), r.output
    refused = ("error: calibration is too noisy to trust (noisy: 1 point spread over 25% (worst 33.3% at CPU expert, "
               f"1 tokens)); no profile written, the measurements are in {raw}: rerun cmoe calibrate on a quiet "
               "machine, or without --strict")
    assert r.output.splitlines()[-1] == refused
    r = CliRunner().invoke(app, cal + ["--policy", "upper,commit"])
    assert r.exit_code == 0 and out.is_file(), r.output
    assert not [x for x in r.output.splitlines() if "noisy" in x]
    out.unlink()
    r = CliRunner().invoke(app, cal + ["--policy", "upper,static"])
    assert r.exit_code == 2 and not out.exists() and r.output.splitlines()[-1] == refused, r.output


def test_a_calibration_for_gpu_only_policies_prices_no_cpu_layer(checkpoints, tiny_trace, tmp_path, monkeypatch):
    """`cmoe calibrate --policy` naming GPU-only policies builds the model without CPU copies of its
    experts (on a GPU, `static` would build them), as `cmoe run` of those policies does, and runs
    no CPU expert inside it: the profile then refuses to price the CPU-expert policies by name, and
    `all` leaves them out with a note."""
    from typer.testing import CliRunner

    import cmoe.executor.run as run
    from cmoe.cli.app import app
    built, build = [], run.build
    monkeypatch.setattr(run, "build", lambda w, cfg, *a, **k: built.append(cfg.policies) or build(w, cfg, *a, **k))
    out = tmp_path / "gpu-only.json"
    r = CliRunner().invoke(app, ["calibrate", "--device", "cpu", "--model", str(checkpoints["mixtral"]),
                                 "--quant", "fp32", "--out", str(out), "--policy", "upper,commit"])
    assert r.exit_code == 0, r.output
    assert built == [("upper",)]                       # the model's store, built once, for upper alone
    assert load_profile(str(out)).cpu_layer_unmeasured()
    sim = ["simulate", "--trace", str(tiny_trace), "--profile", str(out), "--pool-gb", "0.2686", "--policy"]
    r = CliRunner().invoke(app, sim + ["upper,static"])
    assert r.exit_code == 2 and len(r.output.splitlines()) == 1 and "cannot price static" in r.output, r.output
    r = CliRunner().invoke(app, sim + ["all"])
    assert r.exit_code == 0 and "left out lfu-fallback, static: profile cpu has no measured host time" in r.output
