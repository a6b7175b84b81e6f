"""Issue 15's second condition across every session at once: predict one grid of configurations
(pools x batches x policies, the trace the GPU runs used) with each stored calibration and count,
for every pair of calibrations, the rows they predict within 2% of each other.

`validate_table.py --against` does this for one pair and only where measured runs lie beside it;
this needs nothing but the profiles (each results folder's `head.tgz` keeps `profile.json` and
`results.json`), so it runs on the CPU, long after the loans are gone:

    python benchmarks/calibrations_matrix.py benchmarks/results/validate-lean-h100-*/ \
        [--pools 16,20,26] [--batches 1,2,4,8] [--policies upper,ondemand,...] [--out M.json]

Every folder's profile must price the same model and expert format (the first folder's); a
folder whose run was given its profile (`--profile`) rather than calibrating is left out, by name. A
calibration that ran no CPU experts inside the model cannot price `lfu-fallback` or `static`
(`cmoe.sim.priced.check_cpu_layer`): its pairs count the rows both can price.

Each pair names the OpenMP settings its calibrations ran under (the profile's `omp_wait_policy`, or
where it has none the environment `validate_h200.py` recorded from bcd7a0d on, `omp_env`;
"unrecorded" before that, whose runs left libgomp's default as far as the logs say). From 1216acc to 49eb55a every
validation calibrated beside the spinning team (`ACTIVE`), which moved GPU-only runs 0.7-1.3% on
a lent H100 (thirty-seventh session); from 49eb55a a GPU-only one does not, so a pair across that
line carries it.
"""

from __future__ import annotations

import argparse
import json
import sys
import tarfile
import tempfile
from dataclasses import fields, replace
from itertools import combinations
from pathlib import Path
from types import SimpleNamespace

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from cmoe.analysis.validate import calibrations_agree  # noqa: E402
from cmoe.cli.common import numbers  # noqa: E402
from cmoe.core.errors import CmoeError  # noqa: E402
from cmoe.core.hw import HardwareProfile, load_profile  # noqa: E402
from cmoe.core.hw_variants import HOST_FIELDS, HOST_POINTS  # noqa: E402
from cmoe.core.spec import preset  # noqa: E402
from cmoe.core.util import write_text_atomic  # noqa: E402
from cmoe.executor.omp_wait import describe  # noqa: E402
from cmoe.pipeline import predict  # noqa: E402
from cmoe.policy.policies import trait  # noqa: E402
from cmoe.sim.priced import priceable  # noqa: E402
from cmoe.trace.load import load_trace  # noqa: E402

POLICIES = "upper,ondemand,lru-prefetch,commit,oracle,lfu-fallback,static"   # `upper` and the six validated
# the profile's fields by the part of the machine they price (`--explain`); "gpu" is every other
# cost (name, sources and the recorded OpenMP and page settings price nothing)
GROUPS = {"link": ("h2d_pinned", "d2h_pinned", "h2d_pageable_gbps", "copy_engines", "h2d_queued_us"),
          "host": (*HOST_FIELDS, *HOST_POINTS, "host_wake_points", "host_route_waits", "host_pass_start_points", "host_boundary_points", "python_host", "readback_copy_us"),
          "cpu": ("cpu_expert_gbps", "cpu_expert_us_per_token", "roundtrip_us", "roundtrip_points", "cpu_wake_points",
                  "cpu_expert_points")}
GROUPS["gpu"] = tuple(f.name for f in fields(HardwareProfile)
                      if f.name not in {"name", "sources", "omp_wait_policy", "cpu_pages", "few_experts", *sum(GROUPS.values(), ())})


def read_head(folder: Path, scratch: Path) -> tuple[dict, Path] | None:
    """The folder's results.json and the path of its profile.json (unpacked from head.tgz where
    the folder keeps only that), or None where it holds neither."""
    if (folder / "results.json").is_file() and (folder / "profile.json").is_file():
        return json.loads((folder / "results.json").read_text()), folder / "profile.json"
    tgz = folder / "head.tgz"
    if not tgz.is_file():
        return None
    dest = scratch / folder.name
    dest.mkdir(parents=True, exist_ok=True)
    with tarfile.open(tgz) as t:
        names = set(t.getnames())
        if not {"results.json", "profile.json"} <= names:
            return None
        for n in ("results.json", "profile.json"):
            t.extract(n, dest, filter="data")
    return json.loads((dest / "results.json").read_text()), dest / "profile.json"


def calibrations(folders: list[Path], scratch: Path) -> list[tuple[str, dict, Path]]:
    """(name, results, profile path) of each folder that holds a calibration of its own (made in
    that GPU run, `own_calibration`); the others are left out by name. Two folders of one name are
    refused (their scratch copies would collide)."""
    names = [f.name for f in folders]
    if twice := next((n for n in names if names.count(n) > 1), None):
        sys.exit(f"calibrations_matrix: two folders are named {twice}: give each once")
    heads = []
    for f in folders:
        got = read_head(f, scratch)
        if got is None:
            print(f"left out {f}: no results.json and profile.json", file=sys.stderr)
        elif "spec" not in got[0]:
            print(f"left out {f}: its results.json names no model (spec)", file=sys.stderr)
        elif not own_calibration(got[0]):
            print(f"left out {f}: its profile was given (--profile), not calibrated in that run", file=sys.stderr)
        else:
            heads.append((f.name, *got))
    if len(heads) < 2:
        sys.exit("calibrations_matrix: give at least two folders with a calibration of their own")
    return heads


def own_calibration(res: dict) -> bool:
    """Whether a GPU run calibrated its profile itself (on the built or the cut model: validate_h200
    records `calibrated_on` or the time it took), rather than being given one with --profile."""
    return "calibrated_on" in res or any(k.startswith("calibrate") and k.endswith("_s") for k in res)


def grid(profile, spec, trace_src: str, fmt: str, pools, batches, policies, tokens: int, work: Path) -> dict:
    """(pool, batch, policy) -> predicted decode tokens/s under `profile`; a CPU-expert policy only
    where the profile's calibration ran CPU experts in the model (`check_cpu_layer`)."""
    policies = priceable(profile, policies, every=True)[0]
    out = {}
    for b in batches:
        w = SimpleNamespace(trace=load_trace(trace_src, None, b), spec=spec, fmt=fmt)
        for pool in pools:
            cfg = SimpleNamespace(policies=policies, pool_gb=pool, batch=b, slots=None, tokens=tokens,
                                  include_prefill=True, python_step=None)
            for s in predict(w, cfg, profile, work / f"pool{pool:g}-b{b}"):
                out[(pool, b, s.config.policy)] = s.metrics["tokens_per_s"]
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("folders", type=Path, nargs="+")
    ap.add_argument("--pools", default="16,20,26")
    ap.add_argument("--batches", default="1,2,4,8")
    ap.add_argument("--policies", default=POLICIES)
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--explain", action="store_true",
                    help="also predict with the first calibration given each other's link, host, CPU and GPU fields "
                    "in turn, and count the rows each brings within 2%% of the other's: which part separates them")
    a = ap.parse_args()
    pools, batches = numbers(a.pools, "--pools"), numbers(a.batches, "--batches", integer=True)
    policies = a.policies.split(",")
    with tempfile.TemporaryDirectory() as tmp:
        heads = calibrations(a.folders, Path(tmp) / "heads")
        first = heads[0][1]
        key = (first["spec"], first.get("trace") or f"synthetic:{first['spec']}", first.get("expert_format", "w4g128"))
        preds, profs, omp = {}, {}, {}
        for name, res, prof_path in heads:
            here = (res["spec"], res.get("trace") or f"synthetic:{res['spec']}", res.get("expert_format", "w4g128"))
            if here != key:
                print(f"left out {name}: it priced {here}, not {key}", file=sys.stderr)
                continue
            profs[name] = load_profile(str(prof_path))
            omp[name] = omp_record(profs[name], res)
            preds[name] = grid(profs[name], preset(key[0]), key[1], key[2], pools, batches,
                               policies, a.tokens, Path(tmp) / "sim" / name)
            print(f"predicted {len(preds[name])} rows with {name} ({res.get('card')}, tree {res.get('commit')})",
                  file=sys.stderr)
        if len(preds) < 2:
            sys.exit("calibrations_matrix: fewer than two calibrations price the same model")
        pairs = agreement(preds, omp)
        base, *rest = preds
        explained = {}
        for other in rest if a.explain else []:
            def sim(prof, tag, other=other):
                return grid(prof, preset(key[0]), key[1], key[2], pools, batches, policies, a.tokens,
                            Path(tmp) / "sim" / f"{other}-{tag}")
            explained[other] = explain(profs[base], profs[other], preds[other], sim)
    print(table(pairs))
    for other, parts in explained.items():
        print(f"\n{base} against {other}, rows within 2% of the latter's prediction (of {len(preds[other])}, "
              f"{sum(not trait(k[2], 'cpu_experts') for k in preds[other])} GPU-only), all / GPU-only:")
        print(explain_table(parts))
    doc = {"pools": pools, "batches": batches, "policies": policies, "tokens": a.tokens, "pairs": pairs,
           "explained": {o: {"base": base} | c for o, c in explained.items()},   # group -> [all, GPU-only]
           "predicted": {n: [[p, b, pol, v] for (p, b, pol), v in g.items()] for n, g in preds.items()}}
    if a.out:
        write_text_atomic(a.out, json.dumps(doc, indent=1))


def omp_record(profile: HardwareProfile, res: dict) -> str:
    """The OpenMP settings a calibration ran under: its profile's record, else the environment
    `validate_h200.py` kept in results.json (`omp_env`, as libgomp reads it), else "" (unrecorded)."""
    if profile.omp_wait_policy:
        return profile.omp_wait_policy
    return describe(res["omp_env"]) if isinstance(res.get("omp_env"), dict) else ""


def agreement(preds: dict[str, dict], omp: dict[str, str] | None = None) -> list[dict]:
    """For every pair of calibrations (in the order given), how many rows the two predict within 2%
    of each other, over all rows and over the GPU-only policies', the three largest differences, and
    the OpenMP settings each calibrated under (`omp`: name -> `omp_record`; "" unrecorded)."""
    pairs, omp = [], omp or {}
    for x, y in combinations(preds, 2):
        c = _agree(preds[x], preds[y])
        pairs.append({"a": x, "b": y, "rows": c["rows"], "within_2pct": c["within"], "gpu_rows": c["gpu_rows"],
                      "gpu_within_2pct": c["gpu_within"], "worst": [list(d) for d in c["beyond"][:3]],
                      "omp": [omp.get(x, ""), omp.get(y, "")]})
    return pairs


def _agree(base: dict, other: dict) -> dict:
    """`calibrations_agree` over the rows both predictions hold, relative to `base`: all of them and
    the GPU-only policies' alone (their counts and those within 2%), and every row beyond."""
    rows = [{"pool_gb": p, "batch": b, "policy": pol, "predicted_tok_s": v, "other_tok_s": other[p, b, pol]}
            for (p, b, pol), v in base.items() if (p, b, pol) in other]          # the rows both can price
    gpu = [r for r in rows if not trait(r["policy"], "cpu_experts")]
    n, beyond = calibrations_agree(rows, key="other_tok_s")
    return {"rows": len(rows), "within": n, "gpu_rows": len(gpu),
            "gpu_within": calibrations_agree(gpu, key="other_tok_s")[0], "beyond": beyond}


def hybrid(a: HardwareProfile, b: HardwareProfile, group: str) -> HardwareProfile:
    """`a` with `b`'s fields of one group (`GROUPS`), and what `b`'s sources say of them."""
    src = {k: v for k, v in a.sources.items() if k not in GROUPS[group]}
    return replace(a, **{f: getattr(b, f) for f in GROUPS[group]},
                   sources=src | {k: v for k, v in b.sources.items() if k in GROUPS[group]})


def within(pred: dict, other: dict) -> tuple[int, int]:
    """Rows of `pred` within 2% of `other`'s prediction of the same row (relative to `other`):
    all of them, and the GPU-only policies' alone."""
    c = _agree(other, pred)
    return c["within"], c["gpu_within"]


def explain(a: HardwareProfile, b: HardwareProfile, b_pred: dict, sim) -> dict:
    """Which part of the machine separates calibration `a` from `b`: for each group of fields, the
    rows `b` predicts that `a` given that group of `b`'s comes within 2% of ("alone": the group is
    enough), and that `b` given that group of `a`'s still does ("without": the group does not
    matter). `sim(profile, tag)` predicts the grid."""
    return {"alone": {g: within(sim(hybrid(a, b, g), f"alone-{g}"), b_pred) for g in GROUPS},
            "without": {g: within(sim(hybrid(b, a, g), f"without-{g}"), b_pred) for g in GROUPS}}


def explain_table(parts: dict) -> str:
    out = ["| | " + " | ".join(GROUPS) + " |", "| --- |" + " ---: |" * len(GROUPS)]
    for k, what in (("alone", "the first with the second's group"), ("without", "the second with the first's group")):
        out.append(f"| {what} | " + " | ".join(f"{n} / {g}" for n, g in parts[k].values()) + " |")
    return "\n".join(out)


def table(pairs: list[dict]) -> str:
    out = ["| calibration A | calibration B | OpenMP (A / B) | rows within 2% | GPU-only rows within 2% "
           "| largest differences (B / A - 1) |",
           "| --- | --- | --- | ---: | ---: | --- |"]
    for p in pairs:
        worst = "; ".join(f"pool {q:g} b{b} {pol} {d * 100:+.1f}%" for q, b, pol, d in p["worst"]) or "-"
        omp = " / ".join(w or "unrecorded" for w in p.get("omp") or ("", ""))
        out.append(f"| {p['a']} | {p['b']} | {omp} | {p['within_2pct']} of {p['rows']} "
                   f"| {p['gpu_within_2pct']} of {p['gpu_rows']} | {worst} |")
    return "\n".join(out)


if __name__ == "__main__":
    try:
        main()
    except (CmoeError, OSError, json.JSONDecodeError, tarfile.TarError) as e:   # one line, no traceback
        sys.exit(f"calibrations_matrix: {e}")
