#!/usr/bin/env bash
# Runs on the GPU machine, from the repository root, with what tests/gpu/carry.sh built carried
# (.whl, .carry, .kbuild). Usage: bash tests/gpu/on_device.sh "<pytest args>" "<benchmark command>"
# Logs and JSON go to $OUT; with PACK_OUT=1 they end up in one file, $OUT/results.tgz (for a
# machine that hands back only a few files: keep the caller's own logs out of $OUT then).
set -uo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
[ -s .carry/vllm-py.tar.xz ] && tar xJf .carry/vllm-py.tar.xz -C /tmp/site
export PYTHONPATH=/tmp/site:$PWD KVDEPOT_KERNELS_SO=$PWD/.kbuild/libkvdepot_kernels.so KVDEPOT_NO_JIT=1 PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
nvidia-smi --query-gpu=name,memory.total,pcie.link.gen.current,pcie.link.width.current --format=csv | tee "$OUT/gpu.txt"
if [ -n "${1:-}" ]; then
  timeout "${PYTEST_TIMEOUT_S:-300}" python3 -m pytest -p no:cacheprovider -v -rs $1 2>&1 | tee "$OUT/pytest.log" | tail -40
fi
if [ -n "${2:-}" ]; then
  timeout "${BENCH_TIMEOUT_S:-240}" bash -c "$2" 2>&1 | grep -v " INFO kvdepot" | tee "$OUT/bench.log" | tail -30
fi
if [ -n "${PACK_OUT:-}" ]; then
  tar czf /tmp/kvdepot-results.tgz -C "$OUT" . && find "$OUT" -mindepth 1 -delete && mv /tmp/kvdepot-results.tgz "$OUT/results.tgz"
  echo "packed into $OUT/results.tgz"
fi
