"""Sweep points: every simulation setting a point may give, a grid of them, or a file of them
(YAML, JSON or CSV), each with a stable id so a resumed sweep knows what is done.

A point is a dict over `SETTINGS`; what it leaves out takes the default. In a YAML or JSON file
the points are a list of mappings (or a mapping with a `points` list); in a CSV file one row
each, a header naming the settings, an empty cell meaning the default. Example (YAML):

    - {trace: "synthetic:mixtral-8x7b", policy: commit, pool_gb: 16, batch: 4, decode_steps: 64}
    - {trace: embedded, policy: oracle, slots: 4, include_prefill: false}
"""

from __future__ import annotations

import csv
import hashlib
import itertools
import json
from pathlib import Path

from cmoe.core.errors import CmoeError
from cmoe.trace.load import DEFAULT_TRACE

# setting -> (type, default)
SETTINGS: dict[str, tuple[type, object]] = {
    "trace": (str, DEFAULT_TRACE), "profile": (str, "h200"), "quant": (str, None), "policy": (str, "commit"),
    "pool_gb": (float, 20.0), "batch": (int, 1), "slots": (int, None), "include_prefill": (bool, True),
    "groups": (int, None), "decode_steps": (int, None), "engine": (str, "replay"),
}
_TRUE, _FALSE = {"true", "1", "yes", "y"}, {"false", "0", "no", "n"}


def _value(key: str, v, where: str):
    typ, default = SETTINGS[key]
    if v is None or (isinstance(v, str) and v.strip() == ""):
        return default
    if typ is bool:
        if isinstance(v, bool):
            return v
        if isinstance(v, str) and v.strip().lower() in _TRUE | _FALSE:
            return v.strip().lower() in _TRUE
    elif typ is int and not isinstance(v, bool):
        try:
            f = float(v)
            if f == int(f):
                return int(f)
        except (TypeError, ValueError, OverflowError):
            pass
    elif typ is float and not isinstance(v, bool):
        try:
            return float(v)
        except (TypeError, ValueError):
            pass
    elif typ is str and isinstance(v, (str, int, float)) and not isinstance(v, bool):
        return str(v)
    kind = {bool: "true or false", int: "a whole number", float: "a number", str: "text"}[typ]
    raise CmoeError(f"{where}: {key} is {v!r}, not {kind}: fix the points file")


def normalise(point: dict, where: str = "a point") -> dict:
    """Every setting, in SETTINGS order, with its default where the point gives none."""
    if not isinstance(point, dict):
        raise CmoeError(f"{where} is {type(point).__name__}, not a mapping of settings: fix the points file")
    unknown = [k for k in point if k not in SETTINGS]
    if unknown:
        raise CmoeError(f"{where} has an unknown setting '{unknown[0]}': use {', '.join(SETTINGS)}")
    return {k: _value(k, point.get(k), where) for k in SETTINGS}


def point_id(point: dict) -> str:
    """A short id of the point's settings (defaults filled in), the same however it was given."""
    canon = json.dumps(normalise(point), sort_keys=True)
    return hashlib.sha256(canon.encode()).hexdigest()[:16]


def grid(traces: list[str], profiles: list[str], pools: list[float], policies: list[str], batches: list[int],
         quant: str | None = None, engine: str = "replay") -> list[dict]:
    """The product of the axes, in the order `cmoe sweep` always ran them."""
    return [normalise({"trace": tr, "profile": pr, "pool_gb": pool, "policy": pol, "batch": b, "quant": quant,
                       "engine": engine})
            for tr, pr, pool, pol, b in itertools.product(traces, profiles, pools, policies, batches)]


def read_points(path: str | Path, defaults: dict | None = None) -> list[dict]:
    """Points from a .yaml/.yml, .json or .csv file; `defaults` fill what a point leaves out."""
    path = Path(path)
    if not path.is_file():
        raise CmoeError(f"{path} does not exist: give --points a YAML, JSON or CSV file of points")
    suffix = path.suffix.lower()
    try:
        text = path.read_text(encoding="utf-8")
        if suffix == ".csv":
            raw: object = list(csv.DictReader(text.splitlines()))
        elif suffix in (".yaml", ".yml"):
            import yaml
            raw = yaml.safe_load(text)
        elif suffix == ".json":
            raw = json.loads(text)
        else:
            raise CmoeError(f"{path}: points files end in .yaml, .yml, .json or .csv")
    except (UnicodeDecodeError, json.JSONDecodeError, csv.Error) as e:
        raise CmoeError(f"{path} cannot be read as {suffix[1:].upper()}: {str(e).splitlines()[0]}") from None
    except Exception as e:                         # yaml's own errors, without importing yaml for the others
        if type(e).__module__.startswith("yaml"):
            raise CmoeError(f"{path} is not valid YAML: {str(e).splitlines()[0]}") from None
        raise
    if isinstance(raw, dict) and "points" in raw:
        raw = raw["points"]
    if not isinstance(raw, list) or not raw:
        raise CmoeError(f"{path} holds no points: give a list of mappings of settings (see cmoe sweep --help)")
    base = {k: v for k, v in (defaults or {}).items() if v is not None}
    return [normalise({**base, **{k: v for k, v in (p.items() if isinstance(p, dict) else ()) if v not in (None, "")}}
                      if isinstance(p, dict) else p, f"{path} point {i + 1}") for i, p in enumerate(raw)]


_FLAGS = {"trace": "--trace", "profile": "--profile", "pool_gb": "--pool-gb", "policy": "--policy", "batch": "--batch"}


def points_file(path: str | Path, given: dict[str, list], quant: str | None = None, engine: str = "replay") -> list[dict]:
    """`cmoe sweep --points`: the file's points; grid options the user gave (one value each) and
    --quant and --engine fill what a point leaves out."""
    many = next((k for k, v in given.items() if len(v) > 1), None)
    if many:
        raise CmoeError(f"with --points, {_FLAGS[many]} gives what a point leaves out, so one value: "
                        f"give each point its own {many} in the file")
    return read_points(path, {**{k: v[0] for k, v in given.items()}, "quant": quant, "engine": engine})
