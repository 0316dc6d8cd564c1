#!/usr/bin/env bash
# One device call of the orchestrator benchmark (issue 21), run from the repository root on the GPU machine: the
# ATMM extension (a prebuilt one carried in .devpack/ or .engpack/, else built, see build_atmm.sh), then the full
# grid of benchmarks/orchestrator.py at 7B width (skewness 0.1/0.3/0.6/0.9 x 8/64/512 adapters x vlora,
# merge-only, unmerge-only, dlora at one calibrated rate) inside ORCH_BUDGET_S (default 415 s from this script's
# start): once the model, the engine, the switch times and the calibration are ready, every cell gets the same
# arrival window, the longest with which all 48 cells fit at their worst (see --budget-s in orchestrator.py;
# about 3 s of arrivals and up to 3 s of drain, ~170 requests a cell, on the H100), and no cell starts that
# could not end in time.
# No Triton server: it skips device_env.sh.
#   mkdir -p .devpack && cp .engpack/*.so.gz .devpack/ && OUT=$OUT/orch bash benchmarks/device_orchestrator.sh
#       (carry [".engpack"]); then, here: python -m benchmarks.orchestrator --report <$OUT/orch/orchestrator.json>
#       prints the tables, the verdicts and a RESULTS.md section, and records results/orchestrator-<device>.json.
#   ORCH_STEPS   default "bench"; also "test" (the graph tests tests/gpu/test_engine_graphs.py): it runs first and
#                comes out of the budget
#   ORCH_BUDGET_S (default 415), ORCH_ARGS: more arguments for benchmarks/orchestrator.py (e.g. "--drain 2.5")
# Writes $OUT/orchestrator.json (and .partial after every cell), orchestrator.log, model-gen.log, gpu.txt.
set -uo pipefail
T0=$(date +%s)
OUT=${OUT:-$PWD/out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site:$PWD/backend:$PWD/client:$PWD/load${PYTHONPATH:+:$PYTHONPATH}
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv,noheader | tee "$OUT/gpu.txt"
if ! ls .devpack/vlora_atmm_ext*.so.gz >/dev/null 2>&1 && ls .engpack/vlora_atmm_ext*.so.gz >/dev/null 2>&1; then
  mkdir -p .devpack && cp .engpack/vlora_atmm_ext*.so.gz .devpack/
fi
# The random model (made on the GPU, written to /tmp/vlora-bench, orchestrator.py's --work) is written while the
# extension is set up; orchestrator.py finds it there (and writes it itself if this failed).
python3 -c "from vlora.models.random_init import make_random_llava as m; m('configs/models/llava-1.5-7b.yaml', \
'/tmp/vlora-bench/model-llava-1.5-7b')" > "$OUT/model-gen.log" 2>&1 &
GEN=$!
# shellcheck source=/dev/null
source benchmarks/build_atmm.sh
wait $GEN || { echo "model generation failed:"; tail -5 "$OUT/model-gen.log"; }
STEPS=${ORCH_STEPS:-bench}
rc=0
if [[ " $STEPS " == *" test "* ]]; then
  python3 -m pytest -q -p no:cacheprovider tests/gpu/test_engine_graphs.py 2>&1 | tee "$OUT/graph-tests.log" | tail -15
  rc=$(( rc | PIPESTATUS[0] ))
fi
if [[ " $STEPS " == *" bench "* ]]; then
  BUDGET=$(( ${ORCH_BUDGET_S:-415} - ($(date +%s) - T0) ))
  echo "[set-up done at $(( $(date +%s) - T0 )) s; orchestrator.py gets ${BUDGET} s]"
  python3 -m benchmarks.orchestrator --device cuda --require-atmm-ext --budget-s "$BUDGET" --no-record \
    --json-out "$OUT/orchestrator.json" ${ORCH_ARGS:-} 2>&1 | tee "$OUT/orchestrator.log" | tail -90
  rc=$(( rc | PIPESTATUS[0] ))
fi
echo "done in $(( $(date +%s) - T0 )) s"
exit $rc
