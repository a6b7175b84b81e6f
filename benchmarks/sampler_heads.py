"""Issue 15: did the host-load sampler stall the runs it watched? From a validation's folder (the
call's tarballs untarred: poolP-bB/measured/ and host-load.json), for the GPU-only read-back
policies' runs (`upper` left out: its host runs ahead):
- the LM head's host step (`host_head`) over 120 us, and how many hold a sample's time (from
  0.5 ms before their start to their end; a sample every 0.1 s, so by chance well under 1%);
- each pass start (the host from the pass before's head to the end of its own layer 0's
  `host_attention`) by its length, with the share holding a sample;
- the pass start as `cmoe.calibrate.wake.pass_start_samples` reads it (the gap from the head plus
  layer 0's excess) by the length of the pass before, beside the folder's profile's price for it
  (`host_pass_start_us` + `pass_start_extra_us`, its table fitted from the calibration's samples
  where the profile predates the field).
The thirty-sixth session's first call (sampler a thread, whose wake-ups the compiled host program
held off until a pass ended, the program holding the GIL through its syncs): 782 of 871 long heads held a
sample, no short head did; its second (sampler a child process): 8 of 1,328.

    python benchmarks/sampler_heads.py FOLDER [--out R.json]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from types import SimpleNamespace

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from cmoe.analysis.runfolder import read_passes, read_timeline  # noqa: E402
from cmoe.calibrate.wake import fit_pass_start, pass_start_samples  # noqa: E402
from cmoe.core.hw import HardwareProfile  # noqa: E402
from cmoe.core.timeline import END, OP, START, STEP  # noqa: E402
from cmoe.core.util import write_text_atomic  # noqa: E402

BINS_US = (0, 120, 200, 400, float("inf"))
PASS_BINS_MS = (0, 10, 20, 45, 80, 130, 200, 400)


def _profile(folder: Path) -> HardwareProfile:
    d = json.loads((folder / "profile.json").read_text())
    if not d.get("host_pass_start_points"):
        m = json.loads((folder / "profile.measurements.json").read_text())
        d["host_pass_start_points"] = fit_pass_start(m["layer"]["host"].get("pass_start_samples") or [])
    return HardwareProfile.from_dict(d)


def _by_pass(starts: list, prof: HardwareProfile) -> list[dict]:
    a = np.array(starts, dtype=float).reshape(-1, 2)
    out = []
    for lo, hi in zip(PASS_BINS_MS, PASS_BINS_MS[1:]):
        m = (a[:, 0] >= lo * 1e3) & (a[:, 0] < hi * 1e3)
        if m.any():
            prev, got = float(np.median(a[m, 0])), float(np.median(a[m, 1]))
            price = prof.host_pass_start_us + prof.pass_start_extra_us(prev)
            out.append({"pass_ms": [lo, hi], "n": int(m.sum()), "start_us": got, "priced_us": price})
            print(f"pass start after {lo:3d}-{hi:3d} ms: {int(m.sum()):4d} pairs, median {got:5.0f} us, priced {price:5.0f} us")
    return out


def _sampled(folder: Path) -> np.ndarray:
    w = json.loads((folder / "host-load.json").read_text())["windows"]
    return np.array(sorted({r["t0"] for r in w} | {r["t1"] for r in w}))


def holds(ts: np.ndarray, a: float, b: float) -> bool:
    """Does a sample time of `ts` (sorted, epoch s) fall from 0.5 ms before `a` to `b`?"""
    i = int(np.searchsorted(ts, a - 5e-4))
    return bool(i < len(ts) and ts[i] <= b)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("folder", type=Path)
    ap.add_argument("--out", type=Path)
    a = ap.parse_args()
    ts = _sampled(a.folder)
    heads, starts, after = [], [], []
    for mf in sorted(a.folder.glob("pool*-b*/measured/metrics.json")):
        for m in json.loads(mf.read_text()):
            if m["policy"] == "upper":
                continue
            spans = read_timeline(mf.parent, m["policy"])
            log = SimpleNamespace(spans=spans, pass_us=[(p["pass"], p["decode"], p.get("tokens", 1), p["us"])
                                                        for p in read_passes(mf.parent, m["policy"], True)])
            after += [(s[0], s[1] + s[3]) for s in pass_start_samples(log)]
            ep = m["clock_epoch"]
            head = {s[STEP]: (s[START], s[END]) for s in spans if s[OP] == "host_head"}
            first: dict[int, float] = {}
            for s in sorted((s for s in spans if s[OP] == "host_attention"), key=lambda s: s[START]):
                first.setdefault(s[STEP], s[END])
            for p, (h0, h1) in head.items():
                heads.append((h1 - h0, holds(ts, h0 / 1e6 + ep, h1 / 1e6 + ep)))
                if p > 0 and p + 1 in first:
                    starts.append((first[p + 1] - h1, holds(ts, h1 / 1e6 + ep, first[p + 1] / 1e6 + ep)))
    out = {"folder": str(a.folder), "samples": len(ts)}
    for name, rows in (("heads", heads), ("pass_starts", starts)):
        r = np.array(rows, dtype=float).reshape(-1, 2)
        out[name] = []
        for lo, hi in zip(BINS_US, BINS_US[1:]):
            m = (r[:, 0] >= lo) & (r[:, 0] < hi)
            out[name].append({"us": [lo, hi], "n": int(m.sum()), "with_a_sample": int(r[m, 1].sum())})
            print(f"{name:<11} {lo:5.0f}-{hi:<5.0f} us: {int(m.sum()):5d}, {int(r[m, 1].sum()):5d} holding a sample")
    out["pass_start_by_previous_pass"] = _by_pass(after, _profile(a.folder))
    if a.out:
        write_text_atomic(a.out, json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
