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
