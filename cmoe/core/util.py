"""Small helpers shared by every floor: outputs checked before any work and written atomically
(files and whole folders), percentiles.

Every writer of cmoe goes through `check_output`, `atomic_path` or `atomic_dir`, so the rules hold
everywhere: an output that cannot be written is refused before any work, in one line; an existing
output is refused unless the user passed --force, and then replaced whole (no stale files); and an
output is built under a hidden temporary name beside it and renamed into place at the end, so an
error or a Ctrl-C leaves neither half an output nor the temporary one.
"""

from __future__ import annotations

import errno
import os
import shutil
from contextlib import contextmanager
from glob import escape
from pathlib import Path

from cmoe.core.errors import CmoeError


def check_output(path: str | Path, force: bool = False, folder: bool = False, marker: tuple[str, ...] = (),
                 flag: str = "--out") -> Path:
    """Refuse, in one line, an output `path` (a file, or a folder when `folder`) that cannot be
    written: under a file, in a folder without write permission, of the other kind, or existing
    without `force` (an empty folder counts as free). With `force` a folder is replaced only when
    it holds one of `marker` (the names cmoe's own outputs of that kind always have)."""
    path = Path(path)
    near = path.absolute().parent
    while not near.exists() and near != near.parent:
        near = near.parent
    if not near.is_dir():
        raise CmoeError(f"cannot write {path}: {near} is a file, not a folder: choose another {flag}")
    if not os.access(near, os.W_OK | os.X_OK):
        raise CmoeError(f"cannot write {path}: {near} is not writable: choose another {flag}")
    if not (path.exists() or path.is_symlink()):
        return path
    kind = "folder" if folder else "file"
    if path.is_dir() != folder:
        raise CmoeError(f"{path} is a {'file' if folder else 'folder'} but {flag} names a {kind} here: "
                        f"choose another {flag}")
    if folder and _empty(path):
        return path
    if not force:
        raise CmoeError(f"{path} already exists: choose another {flag} or pass --force to replace it")
    if folder and marker and not any((path / m).exists() for m in marker):
        raise CmoeError(f"{path} is not an output of cmoe (it has no {marker[0]}), so --force does not replace it: "
                        f"choose another {flag} or remove it yourself")
    return path


def _empty(folder: Path) -> bool:
    try:
        return not any(folder.iterdir())
    except OSError:
        return False


def _temp_name(path: Path, kind: str) -> Path:
    return path.parent / f".{path.name}.{kind}-{os.getpid()}"


def _remove(p: Path) -> None:
    """Remove a file or folder; a second Ctrl-C does not cut the cleanup short."""
    while True:
        try:
            if p.is_dir() and not p.is_symlink():
                shutil.rmtree(p, ignore_errors=True)
            else:
                p.unlink(missing_ok=True)
            return
        except KeyboardInterrupt:
            continue


def _remove_stale(path: Path) -> None:
    """Temporary outputs beside `path` left by a cmoe process that no longer runs (killed)."""
    for q in path.parent.glob(f".{escape(path.name)}.tmp-*"):
        pid = q.name.rsplit("-", 1)[1]
        if pid.isdigit() and int(pid) != os.getpid() and not _alive(int(pid)):
            _remove(q)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _cannot_write(path: Path, e: OSError) -> CmoeError:
    why = e.strerror or (str(e).splitlines() or [type(e).__name__])[0]
    todo = "free some disk space" if e.errno == errno.ENOSPC else "choose another output path"
    return CmoeError(f"cannot write {path} ({why}): {todo}")


def _ours(e: OSError, *paths: Path) -> bool:
    """Whether an OSError is about writing our output (no file named, or one of ours)."""
    return e.filename is None or any(str(e.filename).startswith(str(p)) for p in paths)


@contextmanager
def _guarded(path: Path, tmp: Path):
    """A write of `path` through `tmp`: its OSError becomes one line, `tmp` never outlives it."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        _remove_stale(path)
        yield
    except OSError as e:
        if not _ours(e, tmp, path):
            raise
        raise _cannot_write(path, e) from None
    finally:
        _remove(tmp)


@contextmanager
def atomic_path(path: str | Path):
    """Yield a temporary name beside `path`; on success rename it into place, on failure remove
    it. A reader never sees half a file; an OSError of the write is one line."""
    path = Path(path)
    check_output(path, force=True)
    tmp = _temp_name(path, "tmp")
    with _guarded(path, tmp):
        yield tmp
        os.replace(tmp, path)


@contextmanager
def atomic_dir(path: str | Path, force: bool = False, marker: tuple[str, ...] = ()):
    """Yield an empty temporary folder beside `path` to build an output folder in; on success it
    takes the place of `path` (with `force`, replacing an existing one whole), on any failure or
    interrupt it is removed and `path` is left as it was. `marker`: see `check_output`."""
    path = check_output(path, force, folder=True, marker=marker)
    tmp = _temp_name(path, "tmp")
    with _guarded(path, tmp):
        _remove(tmp)
        tmp.mkdir()
        yield tmp
        _swap_into_place(tmp, path)


def _swap_into_place(tmp: Path, path: Path) -> None:
    if not path.exists():
        os.rename(tmp, path)
        return
    old = _temp_name(path, "old")
    os.rename(path, old)
    try:
        os.rename(tmp, path)
    except BaseException:
        os.rename(old, path)                       # put the old output back
        raise
    _remove(old)


def write_bytes_atomic(path: str | Path, data: bytes) -> Path:
    with atomic_path(path) as tmp:
        tmp.write_bytes(data)
    return Path(path)


def write_text_atomic(path: str | Path, text: str) -> Path:
    return write_bytes_atomic(path, text.encode("utf-8"))


def percentile(xs: list[float], q: float) -> float:
    """The q-quantile of xs by the nearest rank (nan for none)."""
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(q * (len(xs) - 1))))] if xs else float("nan")


def host_program_on() -> bool:
    """`CMOE_HOST_PROGRAM` is not "0": the lean engine may plan in its compiled host program (the
    executor's switch, which `cmoe.pipeline.predict` reads to price the same host)."""
    return os.environ.get("CMOE_HOST_PROGRAM", "1") != "0"


@contextmanager
def env_var(name: str, value: str):
    """`name` set to `value` inside the block, then restored (or unset) as it was: that variable
    alone, where `unittest.mock.patch.dict` puts back the whole environment."""
    was = os.environ.get(name)
    os.environ[name] = value
    try:
        yield
    finally:
        if was is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = was
