#!/usr/bin/env bash
# One device call for the engine (run from the repository root on the GPU machine): the ATMM extension
# (a prebuilt one carried in .devpack/, else built, see build_atmm.sh), the engine's GPU tests, then the
# engine benchmark. Needs no Triton server, so it skips device_env.sh.
#   HOST_CHECK_US  default 10: before each timed step, log the GPU's load and processes, time a small kernel
#                  (step_kernels.py --check-host) and exit 3 on a slow or busy GPU; 0 skips the check
#   ENGINE_STEPS   default "test floor"; "cache": benchmarks/cache_ttft.py (TTFT, encoder and prefix caches off/on);
#                  "gemv" (run first): benchmarks/gemv_probe.py ${GEMV_ARGS} times the decode-row projection kernels
#                  against cuBLAS and writes $OUT/gemv-table.json, exported as VLORA_GEMV_TABLE to the later steps
#                  (their GPU tests: ENGINE_TESTS=tests/gpu/test_gemv_gpu.py; the engine with them: FLOOR_ARGS with
#                  --gemv-max-rows 0 --variants base,gemv for cuBLAS against them; they are on by default)
#   ENGINE_TESTS   default the engine's GPU tests (paged attention, graphs, parity with transformers + PEFT)
#   FLOOR_ARGS     arguments of benchmarks/engine_floor.py (default --quick)
#   CACHE_ARGS     arguments of benchmarks/cache_ttft.py (default none: LLaVA-1.5-7B and Qwen2-VL-7B)
#   ATMM steps (in this order, after the engine's): "atmmbench" (benchmarks/atmm.py ${ATMM_BENCH_ARGS:---quick}),
#   "atmm" (the ATMM and merge GPU tests, ATMM_TESTS, under `timeout ${ATMM_TEST_TIMEOUT:-300}`)
set -uo pipefail
OUT=${OUT:-$PWD/out}
mkdir -p "$OUT" /tmp/site
export PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site:$PWD/backend:$PWD/client:$PWD/load${PYTHONPATH:+:$PYTHONPATH}
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,utilization.gpu,power.draw,clocks_throttle_reasons.active --format=csv,noheader | tee "$OUT/gpu.txt"
nvidia-smi --query-compute-apps=pid,used_memory --format=csv,noheader | tee -a "$OUT/gpu.txt"
# shellcheck source=/dev/null
source benchmarks/build_atmm.sh
STEPS=${ENGINE_STEPS:-"test floor"}
rc=0
# A host that runs every kernel several times slow (seen on some machines; the copy probe reads normal there,
# and a host can turn slow during a call) spoils every timing: right before each timed step, check again and
# stop there unless HOST_CHECK_US is 0. The GPU's load, power and clocks go to the log beside the figure: a
# busy GPU while this call is idle means something else runs on it. (The slow "hosts" seen were most likely
# ATMM tuner sidecars that GPU tests had started and left running on an H200, which has no committed tiling
# table: the sidecar now ends with the process that started it.)
host_check() {
  [[ "${HOST_CHECK_US:-10}" == "0" ]] && return 0
  nvidia-smi --query-gpu=utilization.gpu,power.draw,clocks.sm,clocks.mem,temperature.gpu,clocks_throttle_reasons.active \
    --format=csv,noheader | sed "s/^/[host check before $1] GPU util, power, clocks, temp, throttle: /" | tee -a "$OUT/host-check.log"
  local apps
  apps=$(nvidia-smi --query-compute-apps=pid,process_name,used_memory --format=csv,noheader)
  if [[ -n "$apps" ]]; then  # nothing of this call runs between its steps: these share the GPU with the next
    echo "$apps" | sed "s/^/[host check before $1] on the GPU: /" | tee -a "$OUT/host-check.log"
    echo "busy GPU before $1: no timed step run (HOST_CHECK_US=0 runs them anyway)"
    exit 3
  fi
  python3 -m benchmarks.step_kernels --check-host "${HOST_CHECK_US:-10}" >> "$OUT/host-check.log" 2>&1
  local hc=$?
  tail -1 "$OUT/host-check.log"
  if [[ $hc -eq 3 ]]; then
    echo "slow host before $1: no timed step run (HOST_CHECK_US=0 runs them anyway)"
    exit 3
  fi
}
if [[ " $STEPS " == *" gemv "* ]]; then
  host_check gemv
  t0=$(date +%s)
  python3 -m benchmarks.gemv_probe ${GEMV_ARGS:-} --out "$OUT" --table-out "$OUT/gemv-table.json" 2>&1 |
    tee "$OUT/gemv-probe.log" | tail -45
  rc=$(( rc | PIPESTATUS[0] ))
  if [[ -s "$OUT/gemv-table.json" ]]; then
    export VLORA_GEMV_TABLE="$OUT/gemv-table.json"
    echo "VLORA_GEMV_TABLE=$VLORA_GEMV_TABLE for the later steps"
  fi
  echo "benchmarks/gemv_probe.py: $(( $(date +%s) - t0 )) s"
fi
if [[ " $STEPS " == *" test "* ]]; then
  t0=$(date +%s)
  python3 -m pytest -q --maxfail=20 -p no:cacheprovider --durations=8 \
    ${ENGINE_TESTS:-tests/gpu/test_paged_attention_gpu.py tests/gpu/test_engine_graphs.py tests/gpu/test_engine_cuda.py} \
    2>&1 | tee "$OUT/engine-tests.log" | tail -40
  trc=${PIPESTATUS[0]}
  rc=$(( rc | trc ))
  echo "engine GPU tests: rc=$trc, $(( $(date +%s) - t0 )) s"
fi
if [[ " $STEPS " == *" floor "* ]]; then
  host_check floor
  python3 -m benchmarks.engine_floor ${FLOOR_ARGS:---quick} --out "$OUT" 2>&1 | tee "$OUT/engine-floor.log" | tail -60
  rc=$(( rc | PIPESTATUS[0] ))
fi
if [[ " $STEPS " == *" cache "* ]]; then
  host_check cache
  t0=$(date +%s)
  python3 -m benchmarks.cache_ttft ${CACHE_ARGS:-} --out "$OUT" 2>&1 | tee "$OUT/cache-ttft.log" | tail -30
  rc=$(( rc | PIPESTATUS[0] ))
  echo "benchmarks/cache_ttft.py: $(( $(date +%s) - t0 )) s"
fi
if [[ " $STEPS " == *" atmmbench "* ]]; then
  host_check atmmbench
  t0=$(date +%s)
  python3 -m benchmarks.atmm ${ATMM_BENCH_ARGS:---quick} --out-dir "$OUT" --table-out "$OUT/tiling-table.json" 2>&1 |
    tee "$OUT/atmm-bench.log" | tail -25
  rc=$(( rc | PIPESTATUS[0] ))
  echo "benchmarks/atmm.py: $(( $(date +%s) - t0 )) s"
fi
if [[ " $STEPS " == *" atmm "* ]]; then
  t0=$(date +%s)
  timeout "${ATMM_TEST_TIMEOUT:-300}" python3 -m pytest -q --maxfail=20 -p no:cacheprovider --durations=8 \
    ${ATMM_TESTS:-tests/gpu/test_atmm_merge.py tests/gpu/test_atmm_gpu.py tests/gpu/test_atmm_stream.py \
      tests/gpu/test_atmm_sm90.py tests/gpu/test_atmm_triton.py} 2>&1 | tee "$OUT/atmm-tests.log" | tail -30
  rc=$(( rc | PIPESTATUS[0] ))
  echo "ATMM GPU tests: $(( $(date +%s) - t0 )) s"
fi
exit $rc
