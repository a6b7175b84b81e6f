"""The fast replay of the SimPy model (see engine.py): `Replay(policy, profile, costs, passes).simulate()`.

The compiled code is cached on disk (numba), in a folder named after a hash of this package's
compiled modules, the executor's compiled host program's (`cmoe.executor.host_*`, which import this
package first so their functions cache here too) and numba's version: numba checks only the stamp
of a function's own file, so a change in a module it calls would otherwise leave stale machine code. The folder is
`$NUMBA_CACHE_DIR/cmoe-replay-HASH` when that variable is set, else under `~/.cache/cmoe` (or the
temporary folder when neither is writable). The first run on a machine compiles (about 30 s on
a 2-core CI machine); `python -m cmoe.sim.replay.warm` does it ahead (scripts/setup runs it).
"""

import hashlib
import os
import tempfile
from pathlib import Path

import numba


def _cache_dir() -> str:
    here = Path(__file__).parent
    h = hashlib.sha256(numba.__version__.encode())
    for name in ("clock.py", "compute.py", "decide.py", "twin_pool.py"):        # the compiled modules
        h.update(name.encode() + (here / name).read_bytes())
    for f in sorted((here.parents[1] / "executor").glob("host_*.py")):   # the compiled host program's
        h.update(f.name.encode() + f.read_bytes())
    name = f"cmoe-replay-{h.hexdigest()[:12]}"
    bases = [os.environ.get("NUMBA_CACHE_DIR"), os.environ.get("XDG_CACHE_HOME") and Path(os.environ["XDG_CACHE_HOME"]) / "cmoe",
             Path.home() / ".cache" / "cmoe", Path(tempfile.gettempdir()) / "cmoe"]
    for base in bases:
        if not base:
            continue
        try:
            d = Path(base) / name
            d.mkdir(parents=True, exist_ok=True)
            if os.access(d, os.W_OK):
                return str(d)
        except OSError:
            continue
    return str(Path(tempfile.mkdtemp()) / name)


numba.config.CACHE_DIR = _cache_dir()

from cmoe.sim.replay.engine import Replay  # noqa: E402  (after the cache folder is set)

__all__ = ["Replay"]
