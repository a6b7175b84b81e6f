"""`cmoe sweep --ray` on a local Ray cluster (2 CPUs, started once for the file): a 1,000-point
sweep, interrupted and resumed without recomputing a finished point; errors kept in their rows.
Skipped only where Ray is not installed (CI installs it: scripts/setup)."""

import polars as pl
import pytest

ray = pytest.importorskip("ray")

from cmoe.sweep import normalise, point_id, sweep  # noqa: E402

POLICIES = ["upper", "ondemand", "lru-prefetch", "lfu-fallback", "static", "commit", "oracle"]


@pytest.fixture(scope="module")
def cluster():
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, configure_logging=False)
    yield "auto"
    ray.shutdown()


def points(n):
    """n distinct tiny points on the embedded trace: policy x slots x decode steps."""
    out = []
    for i in range(n):
        out.append(normalise({"trace": "embedded", "groups": 1, "policy": POLICIES[i % 7], "slots": 2 + (i // 7) % 7,
                              "decode_steps": 1 + i // 49}))
    return out


def test_a_thousand_points_interrupted_and_resumed(cluster, tmp_path):
    out, pts = tmp_path / "sweep.parquet", points(1000)
    seen = []

    def stop(row, stats):
        seen.append(row["point_id"])
        if stats.computed == 300:
            raise KeyboardInterrupt
    with pytest.raises(KeyboardInterrupt):
        sweep(pts, out, ray=cluster, progress=False, on_row=stop)
    first = pl.read_parquet(out)
    assert first.height == 300 and set(first["point_id"]) == set(seen) and (first["error"] == "").all()
    stats = sweep(pts, out, ray=cluster, resume=True, progress=False, on_row=lambda row, s: seen.append(row["point_id"]))
    assert (stats.points, stats.skipped, stats.computed, stats.failed) == (1000, 300, 700, 0)
    assert len(seen) == len(set(seen)) == 1000                                   # no point ran twice
    df = pl.read_parquet(out)
    assert df["point_id"].to_list() == [point_id(p) for p in pts] and (df["tokens_per_s"] > 0).all()
    kept = df.filter(pl.col("point_id").is_in(first["point_id"].to_list()))
    assert kept.sort("point_id").equals(first.sort("point_id"))                  # finished rows untouched


def test_errors_stay_in_their_rows_on_ray(cluster, tmp_path):
    pts = [normalise({"trace": "embedded", "policy": "commit", "pool_gb": 0.001}),
           normalise({"trace": str(tmp_path / "no-such-trace")}), *points(3)]
    stats = sweep(pts, tmp_path / "s.parquet", ray=cluster, progress=False)
    assert (stats.computed, stats.failed) == (5, 2)
    df = pl.read_parquet(tmp_path / "s.parquet")
    assert df["error"][0].startswith("a 0.00 GB pool cannot hold tiny-moe's resident weights")
    assert "does not exist" in df["error"][1] and (df["error"][2:] == "").all()


def test_ray_gives_the_rows_local_processes_give(cluster, tmp_path):
    pts = points(21)
    sweep(pts, tmp_path / "a.parquet", jobs=1, progress=False)
    sweep(pts, tmp_path / "b.parquet", ray=cluster, progress=False)
    a, b = (pl.read_parquet(tmp_path / f).drop("wall_s") for f in ("a.parquet", "b.parquet"))
    assert a.equals(b)
