"""Layer 0's GPU tail after the host's launch, with the link idle and with a load moving: the
measured runs of one or more folders that `benchmarks/validate_h200.py` (or `gpu_session.sh
validate`) wrote, untarred (`poolP-bB/measured/timeline-POLICY.parquet`), or the timelines that
`lean_h200.py --timelines` wrote (`timeline-lean-bB-P-POLICY[-TAG].parquet`).

    python benchmarks/layer0_tail.py FOLDER [FOLDER ...] [--json OUT.json]

Per decode pass past the first: from the later of layer 0's first mark and the end of the host's
step for it (its last `host_attention` span, the launch) to the end of layer 0's attention span on
the GPU, and whether any load was on the link in that window. A pass's inputs on the compute
stream that wait behind a load (an H2D copy) show as a longer tail beside one; medians per folder,
batch and tag. commit's passes are left out: its layer 0 launches after the read-back of its
first prediction, so its window holds neither the pass's inputs nor P (two `host_attention` spans
at layer 0, the pass's start and the launch).
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import numpy as np
import polars as pl

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from cmoe.policy.policies import POLICIES  # noqa: E402


def tails(path: Path) -> list[tuple[bool, float]]:
    t = pl.read_parquet(path)
    loads = t.filter(pl.col("op") == "load").select(["start_us", "end_us"]).to_numpy()
    out = []
    for step in range(1, int(t["step"].max()) + 1):
        s = t.filter((pl.col("step") == step) & (pl.col("layer") == 0))
        ga = s.filter((pl.col("stream") == "compute") & (pl.col("op") == "attention"))
        ha = s.filter((pl.col("stream") == "host") & (pl.col("op") == "host_attention"))
        if len(ga) == 0 or len(ha) == 0:
            continue
        a0, a1, h1 = ga["start_us"][0], ga["end_us"][0], ha["end_us"].max()
        t0 = max(a0, h1)
        busy = bool(((loads[:, 0] < a1) & (loads[:, 1] > t0)).any()) if len(loads) else False
        out.append((busy, a1 - t0))
    return out


def key(path: Path) -> tuple[int, str] | None:
    """(batch, tag) of a timeline: the validation's folder layout or lean_h200's file names."""
    m = re.search(r"-b(\d+)/measured/timeline-", str(path))
    if m:
        return int(m.group(1)), ""
    m = re.match(r"timeline-lean-b(\d+)-[\d.]+-(.*)\.parquet$", path.name)
    if not m:
        return None                                    # lean_h200's extra copies of a run (b1-upper, b1-commit)
    pol = next((p for p in sorted(POLICIES, key=len, reverse=True) if m.group(2).startswith(p)), "")
    return int(m.group(1)), m.group(2)[len(pol):].lstrip("-")


def main() -> None:
    args, out = sys.argv[1:], None
    if "--json" in args:
        i = args.index("--json")
        out, args = Path(args[i + 1]), args[:i] + args[i + 2:]
    if not args:
        sys.exit("usage: python benchmarks/layer0_tail.py FOLDER [FOLDER ...] [--json OUT.json]")
    rows = []
    print("| folder | batch | tag | passes idle / busy | tail median, link idle | tail median, a load moving |")
    print("| --- | ---: | --- | --- | ---: | ---: |")
    for folder in map(Path, args):
        groups: dict[tuple[int, str], list] = {}
        for f in sorted(folder.rglob("timeline-*.parquet")):
            k = key(f)
            if k is not None and "commit" not in f.name:
                groups.setdefault(k, []).extend(tails(f))
        for (b, tag), v in sorted(groups.items()):
            idle = [x for busy, x in v if not busy]
            moving = [x for busy, x in v if busy]
            med = lambda xs: f"{np.median(xs):.1f}" if xs else "-"
            print(f"| {folder.name} | {b} | {tag or '-'} | {len(idle)} / {len(moving)} | {med(idle)} us | {med(moving)} us |")
            q = lambda xs: [round(float(x), 1) for x in np.percentile(xs, [20, 50, 80])] if xs else None
            rows.append({"folder": folder.name, "batch": b, "tag": tag, "passes_idle": len(idle),
                         "passes_busy": len(moving), "tail_us_idle_p20_50_80": q(idle), "tail_us_busy_p20_50_80": q(moving)})
    if out is not None:
        from cmoe.core.util import write_text_atomic
        write_text_atomic(out, json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
