#!/usr/bin/env bash
# gemlite for the lent GPU (issue 14's comparison, benchmarks/gemlite_side.py): PyPI serves it as
# source only, which ../shared/device/wheels.sh (binary wheels) skips, so build its pure-Python
# wheel here into .whl/ (about 0.2 MB; its needs, numpy, tqdm and triton, are on the GPU image).
# Every gpu_session.sh call installs .whl/*.whl; carry .whl with the call.
set -euo pipefail
cd "$(git rev-parse --show-toplevel)"
mkdir -p .whl
python3 -m pip wheel -q --no-deps --no-cache-dir "gemlite==${GEMLITE_VERSION:-0.6.0.post2}" -w .whl
ls -la .whl
