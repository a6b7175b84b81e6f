"""The held-out sample and the trace prompts that ship with the embedded model, cut from the
held-out files of the training corpus (the same crc32 split as train_moe.py), deterministically.

    python training/make_data.py --out cmoe/data
"""

from __future__ import annotations

import argparse
import sys
import sysconfig
from pathlib import Path


sys.path.insert(0, str(Path(__file__).resolve().parent))
from train_moe import is_heldout, source_files  # noqa: E402  (the same split as training)


def heldout_files(root: Path) -> list[Path]:
    return [p for p in source_files(root) if is_heldout(root, p)]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--corpus", type=Path, default=Path(sysconfig.get_paths()["stdlib"]))
    ap.add_argument("--sample-bytes", type=int, default=32_768)
    ap.add_argument("--prompts", type=int, default=8)
    a = ap.parse_args()
    files = heldout_files(a.corpus)
    sample, prompts = b"", []
    for p in files:
        text = p.read_bytes()
        if len(sample) < a.sample_bytes:
            sample += text[: a.sample_bytes - len(sample)]
        if len(prompts) < a.prompts:
            # the first 'def ' line of the file and what follows, up to 160 bytes, as one line
            i = text.find(b"\ndef ")
            if i >= 0:
                snippet = text[i + 1: i + 161].decode("utf-8", "replace").replace("\n", " ")
                prompts.append(snippet)
    (a.out / "heldout.txt").write_bytes(sample)
    (a.out / "prompts.txt").write_text("\n".join(prompts) + "\n")
    print(f"{len(files)} held-out files; wrote {len(sample)} bytes of held-out text and {len(prompts)} prompts")


if __name__ == "__main__":
    main()
