"""Report size and build time for large timelines, and how long headless Chromium takes to load
and draw them (a proxy for responsiveness: the page is usable once drawn).

    .venv/bin/python benchmarks/report_size.py
"""

from __future__ import annotations

import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from cmoe.core.hw import load_profile  # noqa: E402
from cmoe.report.build import build_report  # noqa: E402
from cmoe.sim.api import write_outputs  # noqa: E402
from cmoe.sim.run import SimConfig, simulate  # noqa: E402
from cmoe.trace.load import load_trace  # noqa: E402


def main() -> None:
    tmp = Path(tempfile.mkdtemp())
    t = load_trace("synthetic:mixtral-8x7b")
    prof = load_profile("h200")
    results = [simulate(t, prof, SimConfig(policy=p, pool_gb=20)) for p in ("commit", "ondemand", "upper")]
    write_outputs(tmp / "run", t, prof, results)
    total = sum(len(r.run.spans) for r in results)
    print(f"spans in the run: {total:,}")
    chromium = shutil.which("chromium")
    print("| span limit (whole passes) | HTML MB | build s (median of 3) | Chromium load+draw s |")
    print("| ---: | ---: | ---: | ---: |")
    for limit in (100_000, 300_000):
        times = []
        for _ in range(3):
            t0 = time.perf_counter()
            page = build_report([tmp / "run"], tmp / f"r{limit}.html", max_spans=limit)
            times.append(time.perf_counter() - t0)
        draw = float("nan")
        if chromium:
            t0 = time.perf_counter()
            subprocess.run([chromium, "--headless", "--no-sandbox", "--use-angle=swiftshader",
                            "--enable-unsafe-swiftshader", "--virtual-time-budget=60000", "--dump-dom", page.as_uri()],
                           capture_output=True, timeout=300)
            draw = time.perf_counter() - t0
        print(f"| {limit:,} | {page.stat().st_size / 1e6:.1f} | {statistics.median(times):.2f} | {draw:.1f} |")


if __name__ == "__main__":
    main()
