import json

import numpy as np
import pytest

from cmoe.core.errors import CmoeError
from cmoe.core.quant import recipe
from cmoe.core.spec import preset
from cmoe.trace import bundle
from cmoe.trace.synthetic import SyntheticParams, generate


@pytest.fixture
def small_trace():
    return generate(preset("olmoe-1b-7b"), recipe("w4a16"), SyntheticParams(requests=2, prompt_len=3, decode_len=5))


def test_round_trip_is_exact(small_trace, tmp_path):
    bundle.write(small_trace, tmp_path / "b", parquet=True)
    t = bundle.read(tmp_path / "b")
    for k in ("experts", "weights", "pred_experts", "request", "step", "phase"):
        assert np.array_equal(getattr(t, k), getattr(small_trace, k)) and getattr(t, k).dtype == getattr(small_trace, k).dtype
    assert t.spec == small_trace.spec and t.recipe == small_trace.recipe and t.expert_bytes == small_trace.expert_bytes
    meta = json.loads((tmp_path / "b" / "meta.json").read_text())
    assert meta["format"] == "cmoe-trace" and meta["format_version"] == 1 and meta["weights_renormalized"] is False
    import polars as pl
    df = pl.read_parquet(tmp_path / "b" / "routes.parquet")
    assert df.height == 16 * 16 and df.schema["experts"].shape == (8,)


def test_existing_bundle_is_kept_unless_forced(small_trace, tmp_path):
    bundle.write(small_trace, tmp_path / "b")
    before = (tmp_path / "b" / "routes.safetensors").read_bytes()
    with pytest.raises(CmoeError, match="already exists"):
        bundle.write(small_trace, tmp_path / "b")
    assert (tmp_path / "b" / "routes.safetensors").read_bytes() == before
    bundle.write(small_trace, tmp_path / "b", overwrite=True)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["b"]       # no temporary left behind


def test_failed_write_leaves_nothing(small_trace, tmp_path):
    small_trace.experts[0, 0, 0] = 99
    with pytest.raises(CmoeError, match="expert id 99 out of range 0..63"):
        bundle.write(small_trace, tmp_path / "b")
    assert list(tmp_path.iterdir()) == []


def test_corrupted_bundles_give_one_line(small_trace, tmp_path):
    bundle.write(small_trace, tmp_path / "b")
    routes = tmp_path / "b" / "routes.safetensors"
    routes.write_bytes(routes.read_bytes()[:100])
    with pytest.raises(CmoeError, match="routes.safetensors is corrupted"):
        bundle.read(tmp_path / "b")
    bundle.write(small_trace, tmp_path / "c")
    (tmp_path / "c" / "meta.json").write_text("{not json")
    with pytest.raises(CmoeError, match="meta.json is corrupted"):
        bundle.read(tmp_path / "c")
    with pytest.raises(CmoeError, match="is not a trace bundle"):
        bundle.read(tmp_path)
    with pytest.raises(CmoeError, match="does not exist"):
        bundle.read(tmp_path / "none")
    (tmp_path / "log.npy").write_bytes(b"")               # a routing log handed over as if it were a bundle
    with pytest.raises(CmoeError, match=r"log.npy is a file, .* `cmoe trace --import .*log.npy --spec PRESET"):
        bundle.read(tmp_path / "log.npy")


def test_version_and_out_of_range_ids_are_refused(small_trace, tmp_path):
    from safetensors.numpy import save_file
    bundle.write(small_trace, tmp_path / "b")
    meta = json.loads((tmp_path / "b" / "meta.json").read_text())
    (tmp_path / "b" / "meta.json").write_text(json.dumps({**meta, "format_version": 7}))
    with pytest.raises(CmoeError, match="format version 7"):
        bundle.read(tmp_path / "b")
    (tmp_path / "b" / "meta.json").write_text(json.dumps(meta))
    arrays = small_trace.arrays()
    arrays["experts"][3, 2, 1] = 64
    save_file(arrays, str(tmp_path / "b" / "routes.safetensors"))
    with pytest.raises(CmoeError, match="expert id 64 out of range"):
        bundle.read(tmp_path / "b")


def test_predictions_by_distance_round_trip_and_old_bundles_read_at_depth_1(small_trace, tmp_path):
    assert small_trace.depth == 4 and small_trace.pred_ahead.shape == (16, 16, 4, 8)
    bundle.write(small_trace, tmp_path / "b")
    t = bundle.read(tmp_path / "b")
    assert np.array_equal(t.pred_ahead, small_trace.pred_ahead) and t.pred_ahead.dtype == np.int16
    from dataclasses import replace
    bundle.write(replace(small_trace, pred_ahead=None), tmp_path / "old")      # what an older cmoe wrote
    old = bundle.read(tmp_path / "old")
    assert old.pred_ahead is None and old.depth == 1
    assert np.array_equal(old.pred_experts, small_trace.pred_experts)      # distance 1 reads as it was


def test_predictions_by_distance_are_checked(small_trace):
    from dataclasses import replace
    bad = small_trace.pred_ahead.copy()
    bad[0, 3, 0, 0] = (bad[0, 3, 0, 0] + 1) % 64
    with pytest.raises(CmoeError, match="pred_ahead at distance 1 differs from pred_experts"):
        bundle.validate(replace(small_trace, pred_ahead=bad))
    with pytest.raises(CmoeError, match=r"pred_ahead has shape \(16, 16, 8\), expected \(16, 16, D, 8\)"):
        bundle.validate(replace(small_trace, pred_ahead=small_trace.pred_experts))
    bad = small_trace.pred_ahead.copy()
    bad[2, 5, 3, 1] = 64
    with pytest.raises(CmoeError, match="pred_ahead expert ids out of range -1..63"):
        bundle.validate(replace(small_trace, pred_ahead=bad))
