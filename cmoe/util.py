"""Small helpers shared by every floor: atomic writes."""

from __future__ import annotations

import os
from pathlib import Path


def write_bytes_atomic(path: str | Path, data: bytes) -> Path:
    """Write to a temporary name beside `path`, then rename: a reader never sees half a file."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.parent / f".{path.name}.tmp-{os.getpid()}"
    try:
        tmp.write_bytes(data)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    return path


def write_text_atomic(path: str | Path, text: str) -> Path:
    return write_bytes_atomic(path, text.encode("utf-8"))
