"""Chrome Trace Event export: the fields Perfetto needs, microseconds, no overlap on a track."""

import json

from cmoe.report.chrome import chrome_trace, write_chrome_trace

SPANS = [("sim", 0, 3, "copy0", "load", 1, 0.0, 10.0, 100), ("sim", 0, 3, "copy0", "load", 2, 5.0, 12.5, 100),
         ("sim", 0, 3, "compute", "expert", 1, 10.0, 12.0, 100), ("gpu", 0, 3, "compute", "attention", -1, 1.0, 2.0, 0)]


def test_schema_and_tracks(tmp_path):
    path = write_chrome_trace(SPANS, tmp_path / "t.json")
    doc = json.loads(path.read_text())
    events = [e for e in doc["traceEvents"] if e["ph"] == "X"]
    assert len(events) == 4
    for e in events:
        assert {"name", "ph", "pid", "tid", "ts", "dur", "args"} <= set(e) and e["dur"] >= 0
    names = {(m["pid"], m["tid"]): m["args"]["name"] for m in doc["traceEvents"] if m["name"] == "thread_name"}
    loads = sorted((e["ts"], names[(e["pid"], e["tid"])]) for e in events if e["cat"] == "load")
    assert loads == [(0.0, "copy0"), (5.0, "copy0#1")]            # overlapping copies on separate tracks
    assert {m["args"]["name"] for m in doc["traceEvents"] if m["name"] == "process_name"} == {"sim", "gpu"}
    # microseconds: the 7.5 us copy keeps its duration
    assert next(e for e in events if e["args"]["expert"] == 2)["dur"] == 7.5


def test_no_overlap_within_a_track():
    doc = chrome_trace(SPANS * 3)
    by_track = {}
    for e in doc["traceEvents"]:
        if e["ph"] == "X":
            by_track.setdefault((e["pid"], e["tid"]), []).append((e["ts"], e["ts"] + e["dur"]))
    for spans in by_track.values():
        spans.sort()
        assert all(b[0] >= a[1] for a, b in zip(spans, spans[1:]))


def _ns_by_track(doc) -> dict:
    """(pid, tid) -> sorted [(start, end)] in integer nanoseconds, read as Perfetto reads numbers
    (llround(us * 1000))."""
    by_track: dict = {}
    for e in doc["traceEvents"]:
        if e["ph"] == "X":
            ts, dur = round(e["ts"] * 1000), round(e["dur"] * 1000)
            by_track.setdefault((e["pid"], e["tid"]), []).append((ts, ts + dur))
    return {k: sorted(v) for k, v in by_track.items()}


def test_end_points_are_rounded_so_touching_spans_still_touch():
    # A ends exactly where B starts; rounding A's start and duration apart gave ts 0.001, dur 10.0:
    # an end at 10.001 us, after B's start at 10.0
    spans = [("sim", 0, 0, "compute", "attention", -1, 0.0006, 10.0004, 0),
             ("sim", 0, 0, "compute", "expert", 3, 10.0004, 12.0, 0)]
    events = [e for e in chrome_trace(spans)["traceEvents"] if e["ph"] == "X"]
    assert [(e["name"], e["ts"], e["dur"]) for e in events] == [("attention", 0.001, 9.999), ("expert e3", 10.0, 2.0)]
    assert len({e["tid"] for e in events}) == 1                     # one track: they do not overlap
    assert _ns_by_track({"traceEvents": events}) == {(1, 1): [(1, 10000), (10000, 12000)]}


def test_no_overlap_on_a_simulated_timeline():
    from cmoe.core.hw import H200
    from cmoe.sim.run import SimConfig, simulate
    from cmoe.trace.load import load_trace
    run = simulate(load_trace("embedded", None, 1), H200, SimConfig(policy="commit", pool_gb=20, slots=4)).run
    by_track = _ns_by_track(chrome_trace(run.spans))
    assert sum(map(len, by_track.values())) == len(run.spans) > 10_000
    overlaps = [(a, b) for v in by_track.values() for a, b in zip(v, v[1:]) if b[0] < a[1]]
    assert overlaps == []
