"""Layer 0's GPU tail after the host's launch, with the link idle and with a load moving: the
measured runs of one or more folders that `benchmarks/validate_h200.py` (or `gpu_session.sh
validate`) wrote, untarred (`poolP-bB/measured/timeline-POLICY.parquet`), or the timelines that
`lean_h200.py --timelines` wrote (`timeline-lean-bB-P-POLICY[-TAG].parquet`).

    python benchmarks/layer0_tail.py FOLDER [FOLDER ...] [--json OUT.json]

Per decode pass past the first: from the later of layer 0's first mark and the end of the host's
step for it (its last `host_attention` span, the launch) to the end of layer 0's attention span on
the GPU, and whether a load was on the link as it began (calibration's rule for the other layers'
copy slowdown: `cmoe.calibrate.commit_steps.attention_tails`). A pass's inputs on the compute
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
from types import SimpleNamespace

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from cmoe.calibrate.commit_steps import attention_tails  # noqa: E402
from cmoe.core.timeline import LAYER, STEP, read_parquet  # noqa: E402
from cmoe.policy.policies import POLICIES  # noqa: E402


def tails(path: Path) -> dict[bool, list]:
    """The timeline's layer-0 tails in us, keyed by whether a load was moving as each began
    (`commit_steps.attention_tails`, which calibration's copy slowdown reads for the other layers)."""
    spans = read_parquet(path)
    first = min(s[LAYER] for s in spans if s[LAYER] >= 0)
    passes = sorted({s[STEP] for s in spans})
    log = SimpleNamespace(spans=spans, pass_us=[(p, p > 0, 0, 0.0) for p in passes])   # pass 0: the prefill
    return attention_tails(log, lambda layer: layer == first)


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
        groups: dict[tuple[int, str], dict[bool, list]] = {}
        for f in sorted(folder.rglob("timeline-*.parquet")):
            k = key(f)
            if k is not None and "commit" not in f.name:
                g = groups.setdefault(k, {True: [], False: []})
                for busy, xs in tails(f).items():
                    g[busy].extend(xs)
        for (b, tag), v in sorted(groups.items()):
            idle, moving = v[False], v[True]
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
