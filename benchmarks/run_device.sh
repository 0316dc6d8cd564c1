#!/usr/bin/env bash
# One device call: build (or take the prebuilt) ATMM extension, run tests/gpu, run the ATMM benchmark.
# Run from the repository root on the GPU machine; writes logs and results under $OUT (default ./out).
#   ATMM_PREBUILT=dir : a folder holding a vlora_atmm_ext*.so built elsewhere (skips the build)
#   ATMM_WHEELS=dir   : wheels to install first (pytest; nvidia-cutlass and pybind11 for the build)
#   ATMM_STEPS="build test bench tune" (default the first three); ATMM_BENCH_ARGS="--quick"
#   ATMM_TUNE_BUDGET=seconds for the tuner step (default 240); ATMM_TUNE_ARGS: its grid (default: widths 4096,5120,
#   ranks 16,64,128, tokens 32..8192, segments 1,4,16,64); ATMM_TESTS="tests/gpu/x.py ..." (default tests/gpu)
set -uo pipefail
OUT=${OUT:-$PWD/out}
mkdir -p "$OUT"
STEPS=${ATMM_STEPS:-"build test bench"}
export PYTHONUNBUFFERED=1
PY=${PYTHON:-python3}
if [ -n "${ATMM_WHEELS:-}" ]; then
  $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site "$ATMM_WHEELS"/*.whl || exit 1
  export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,temperature.gpu --format=csv | tee "$OUT/gpu.txt"
EXT_DIR=${ATMM_PREBUILT:-/tmp/atmm-build}
if [[ " $STEPS " == *" build "* && -z "${ATMM_PREBUILT:-}" ]]; then
  t0=$(date +%s)
  cmake -S csrc -B /tmp/atmm-build -DCMAKE_BUILD_TYPE=Release -DPython_EXECUTABLE="$(command -v $PY)" \
        -DATMM_CUDA_ARCHS="${ATMM_CUDA_ARCHS:-90a}" > "$OUT/build.log" 2>&1 &&
  cmake --build /tmp/atmm-build -j "$(nproc)" >> "$OUT/build.log" 2>&1 || { tail -50 "$OUT/build.log"; exit 1; }
  echo "build: $(( $(date +%s) - t0 )) s"
  gzip -c /tmp/atmm-build/vlora_atmm_ext*.so > "$OUT/vlora_atmm_ext.so.gz"
fi
export PYTHONPATH=$PWD/backend:$EXT_DIR${PYTHONPATH:+:$PYTHONPATH}
$PY -c "import vlora_atmm_ext as m; import torch; print('ext', m.__file__, m.CUDA_ARCHS, len(m.configs()), 'configs; torch', torch.__version__)" || exit 1
rc=0
if [[ " $STEPS " == *" test "* ]]; then
  t0=$(date +%s)
  $PY -m pytest -q --maxfail=5 --durations=5 -p no:cacheprovider ${ATMM_TESTS:-tests/gpu} 2>&1 | tee "$OUT/gpu-tests.log" | tail -25
  rc=${PIPESTATUS[0]}
  echo "tests/gpu: rc=$rc, $(( $(date +%s) - t0 )) s"
fi
if [[ " $STEPS " == *" bench "* ]]; then
  $PY -m benchmarks.atmm ${ATMM_BENCH_ARGS:-} --out-dir "$OUT" --table-out "$OUT/tiling-table.json" 2>&1 | tee "$OUT/bench.log" | tail -40
  rc=$(( rc | PIPESTATUS[0] ))
fi
if [[ " $STEPS " == *" tune "* ]]; then
  $PY -m vlora.atmm.tuner ${ATMM_TUNE_ARGS:---widths 4096,5120 --ranks 16,64,128 --tokens 32,64,128,256,512,1024,2048,4096,8192 --segments 1,4,16,64} \
      --out "$OUT/tiling-tuned.json" --cache-dir /tmp/atmm-tiling-cache \
      --budget-s "${ATMM_TUNE_BUDGET:-240}" > "$OUT/tune.log" 2>&1
  rc=$(( rc | $? ))
  tail -3 "$OUT/tune.log"
fi
exit $rc
