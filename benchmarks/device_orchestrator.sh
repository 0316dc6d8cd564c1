#!/usr/bin/env bash
# One device call of the orchestrator benchmark (issue 21), run from the repository root on the GPU machine:
# the ATMM extension (a prebuilt one carried in .devpack/ or .engpack/, else built, see build_atmm.sh), the
# switch probe (benchmarks/switch_probe.py), then half of the grid of benchmarks/orchestrator.py at 7B width.
# No Triton server: it skips device_env.sh. Two calls make the full grid (skewness 0.1/0.3/0.6/0.9 x 8/64/512
# adapters x four policies), each under ~9 minutes (no cell starts after ORCH_DEADLINE_S):
#   ORCH_PART=1  vlora and merge-only -> $OUT/orchestrator-part1.json. Copy that file into the working tree as
#                benchmarks/results/orchestrator-part1.json before the second call, so that it travels.
#   ORCH_PART=2  unmerge-only and dlora, added to benchmarks/results/orchestrator-part1.json (its request rates
#                reused: every policy sees the same streams) -> $OUT/orchestrator.json; then, here:
#                python benchmarks/orchestrator.py --report <that file>
#   ORCH_STEPS   default "probe bench" for part 1, "test bench" for part 2 (probe: the switch probe; test: the
#                graph tests tests/gpu/test_engine_graphs.py, replays in every mode included; bench: the benchmark)
#   ORCH_DEADLINE_S (default 400, from the benchmark's start), ORCH_ARGS: more arguments for benchmarks/orchestrator.py
# Expected: about 6 minutes a call (the 7B model written and loaded in ~70 s, 24 cells of 6-10 s).
set -uo pipefail
OUT=${OUT:-$PWD/out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site:$PWD/backend:$PWD/client:$PWD/load${PYTHONPATH:+:$PYTHONPATH}
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv,noheader | tee "$OUT/gpu.txt"
if ! ls .devpack/vlora_atmm_ext*.so.gz >/dev/null 2>&1 && ls .engpack/vlora_atmm_ext*.so.gz >/dev/null 2>&1; then
  mkdir -p .devpack && cp .engpack/vlora_atmm_ext*.so.gz .devpack/
fi
# shellcheck source=/dev/null
source benchmarks/build_atmm.sh
PART=${ORCH_PART:-1}
if [ "$PART" = 1 ]; then STEPS=${ORCH_STEPS:-"probe bench"}; else STEPS=${ORCH_STEPS:-"test bench"}; fi
rc=0
if [[ " $STEPS " == *" test "* ]]; then
  python3 -m pytest -q -p no:cacheprovider tests/gpu/test_engine_graphs.py 2>&1 | tee "$OUT/graph-tests.log" | tail -15
  rc=$(( rc | PIPESTATUS[0] ))
fi
if [[ " $STEPS " == *" probe "* ]]; then
  python3 benchmarks/switch_probe.py --json "$OUT/switch-probe.json" 2>&1 | tee "$OUT/switch-probe.log"
  rc=$(( rc | PIPESTATUS[0] ))
fi
if [[ " $STEPS " == *" bench "* ]]; then
  common=(--device cuda --require-atmm-ext --deadline-s "${ORCH_DEADLINE_S:-400}" --no-record)
  if [ "$PART" = 1 ]; then
    python3 benchmarks/orchestrator.py "${common[@]}" --policies vlora,merge-only \
      --json-out "$OUT/orchestrator-part1.json" ${ORCH_ARGS:-} 2>&1 | tee "$OUT/orchestrator-part1.log" | tail -70
  else
    part1=benchmarks/results/orchestrator-part1.json
    [ -f "$part1" ] || { echo "ORCH_PART=2 needs $part1 (the first call's JSON) in the working tree"; exit 2; }
    python3 benchmarks/orchestrator.py "${common[@]}" --policies unmerge-only,dlora --merge-into "$part1" \
      --json-out "$OUT/orchestrator.json" ${ORCH_ARGS:-} 2>&1 | tee "$OUT/orchestrator-part2.log" | tail -90
  fi
  rc=$(( rc | PIPESTATUS[0] ))
fi
exit $rc
