#!/usr/bin/env bash
# On the GPU machine, from the repository root: the engine's GPU tests, then the serving decode
# benchmark through the real tritonserver at LLaVA-1.5-7B dimensions (random weights).
# Wheels that the machine lacks (nvidia-pytriton, peft, pytest, and numpy 1.26 where its image has NumPy 2)
# are read from .whl/ when present: see benchmarks/device_env.sh, which both device scripts source.
# Writes logs and results under $OUT (or benchmarks/results when OUT is unset).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-benchmarks/results}
mkdir -p "$OUT"
source benchmarks/device_env.sh
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
python3 -c 'import torch, transformers; print("torch", torch.__version__, "transformers", transformers.__version__)'
rc=0
[ -n "${SKIP_GPU_TESTS:-}" ] || python3 -m pytest -q -p no:cacheprovider tests/gpu 2>&1 | tee "$OUT/gpu-tests.log" || rc=1
python3 benchmarks/serve_decode.py --preset configs/models/llava-1.5-7b.yaml --work /tmp/vlora-bench "$@" 2>&1 | tee "$OUT/serve-decode.log" || rc=1
cp /tmp/vlora-bench/server.log "$OUT/server.log" 2>/dev/null
tail -c 200000 /tmp/vlora-bench/triton-ws/tritonserver.log > "$OUT/tritonserver.log" 2>/dev/null
python3 benchmarks/engine_decode.py --work /tmp/vlora-bench 2>&1 | tee "$OUT/engine-decode.log" || rc=1
[ -z "${PROFILE:-}" ] || python3 benchmarks/profile_step.py --work /tmp/vlora-bench 2>&1 | tee "$OUT/profile.log"
cp benchmarks/results/serve-decode-*.json benchmarks/results/engine-decode-*.json "$OUT/" 2>/dev/null
tail -n 3 benchmarks/RESULTS.md > "$OUT/RESULTS-lines.md" 2>/dev/null
exit $rc
