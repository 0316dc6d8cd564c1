#!/usr/bin/env bash
# One device call for the engine (run from the repository root on the GPU machine): the ATMM extension
# (a prebuilt one carried in .devpack/, else built, see build_atmm.sh), the engine's GPU tests, then the
# engine benchmark. Needs no Triton server, so it skips device_env.sh.
#   ENGINE_STEPS   default "test floor"
#   ENGINE_TESTS   default the engine's GPU tests (paged attention, graphs, parity with transformers + PEFT)
#   FLOOR_ARGS     arguments of benchmarks/engine_floor.py (default --quick)
set -uo pipefail
OUT=${OUT:-$PWD/out}
mkdir -p "$OUT" /tmp/site
export PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site:$PWD/backend:$PWD/client:$PWD/load${PYTHONPATH:+:$PYTHONPATH}
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv,noheader | tee "$OUT/gpu.txt"
# shellcheck source=/dev/null
source benchmarks/build_atmm.sh
STEPS=${ENGINE_STEPS:-"test floor"}
rc=0
if [[ " $STEPS " == *" test "* ]]; then
  t0=$(date +%s)
  python3 -m pytest -q --maxfail=20 -p no:cacheprovider --durations=8 \
    ${ENGINE_TESTS:-tests/gpu/test_paged_attention_gpu.py tests/gpu/test_engine_graphs.py tests/gpu/test_engine_cuda.py} \
    2>&1 | tee "$OUT/engine-tests.log" | tail -40
  rc=${PIPESTATUS[0]}
  echo "engine GPU tests: rc=$rc, $(( $(date +%s) - t0 )) s"
fi
if [[ " $STEPS " == *" floor "* ]]; then
  python3 benchmarks/engine_floor.py ${FLOOR_ARGS:---quick} --out "$OUT" 2>&1 | tee "$OUT/engine-floor.log" | tail -60
  rc=$(( rc | PIPESTATUS[0] ))
fi
exit $rc
