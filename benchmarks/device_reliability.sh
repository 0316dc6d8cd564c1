#!/usr/bin/env bash
# One device call for issue 26's GPU figures, from the repository root on the GPU machine: benchmarks/reliability.py
# against the real tritonserver at LLaVA-1.5-7B width (random weights): a soak (benchmarks/soak.py's mix at 0.8 x
# its measured capacity), then an overload through the load harness at 2 x the harness workload's measured
# capacity (every request answered or rejected explicitly, 0 lost), on one server. The whole call stays inside
# RELIABILITY_BUDGET_S (default 420 s from this script's start): the soak is shortened to what is left once the
# server is up and the overload's share is set aside (about 2.5 min at 420 s; 4 min needs ~540 s); the minutes
# run are in the result.
#   SOAK_MINUTES (default 4: the most), OVERLOAD_S (default 60), RELIABILITY_ARGS: more reliability.py arguments
#   (e.g. "--probe-s 10 --capacity-s 12 --workload visual_retrieval").
# The machine setup is device_env.sh (as device_serve.sh): it needs .devpack/ with site.tar.xz (tritonserver,
# tritonclient), numpy1.tar.xz, load.tar.xz (locust, gevent, geventhttpclient: the load harness) and the
# ATMM extension's .so.gz (see build_atmm.sh):
#   mkdir -p .devpack && cp .devpack2/site.tar.xz .devpack2/numpy1.tar.xz .devpack2/*.so.gz .devpack/ &&
#     OUT=$OUT/rel bash benchmarks/device_reliability.sh          # carry [".devpack2", ".devpack/load.tar.xz"]
# Writes under $OUT (default benchmarks/device_out): log.txt (everything printed) and reliability.tgz
# (soak-<device>.json, overload-<device>.json, the RESULTS.md lines, the harness's reports and raw CSVs, the
# server's logs). Exit code: reliability.py's (0 both phases passed, 1 one failed, 2 no server).
set -uo pipefail
cd "$(dirname "$0")/.."
T0=$(date +%s)
OUT=${OUT:-benchmarks/device_out}
mkdir -p "$OUT"
exec > >(tee -a "$OUT/log.txt") 2>&1
touch /tmp/reliability.start
source benchmarks/device_env.sh
PRESET=configs/models/llava-1.5-7b.yaml
WORK=/tmp/vlora-reliability
RES=/tmp/reliability-out
rm -rf "$RES" && mkdir -p "$RES"
# The random model (made on the GPU, written to disk) is generated while the extension is set up; reliability.py
# finds it there (and makes it itself if this failed).
python3 -c "from vlora.models.random_init import make_random_llava as m; m('$PRESET', '$WORK/model-llava-1.5-7b')" \
  > /tmp/model-gen.log 2>&1 &
GEN=$!
source benchmarks/build_atmm.sh
wait $GEN || { echo "model generation failed:"; tail -5 /tmp/model-gen.log; }
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
python3 -c 'import locust, gevent, geventhttpclient, tritonclient; print("locust", locust.__version__)' || exit 1
# What is left of the budget, less ~15 s for the server's stop and the bundle.
BUDGET=$(( ${RELIABILITY_BUDGET_S:-420} - ($(date +%s) - T0) - 15 ))
echo "[setup done at $(( $(date +%s) - T0 )) s; reliability.py gets ${BUDGET} s]"
python3 -m benchmarks.reliability --preset "$PRESET" --device cuda --work "$WORK" --out "$RES" \
  --soak-minutes "${SOAK_MINUTES:-4}" --overload-s "${OVERLOAD_S:-60}" --budget-s "$BUDGET" ${RELIABILITY_ARGS:-}
rc=$?
find benchmarks/results -name '*.json' -newer /tmp/reliability.start -exec cp {} "$RES/" \;
tail -n 4 benchmarks/RESULTS.md > "$RES/RESULTS-tail.md"
tail -c 400000 "$WORK/soak-server/ws/tritonserver.log" > "$RES/tritonserver.log" 2>/dev/null
find "$RES/harness" -name 'locust.log' -size +2M -delete 2>/dev/null
tar -C /tmp -czf "$OUT/reliability.tgz" "$(basename "$RES")"
echo "done in $(( $(date +%s) - T0 )) s (rc $rc)"
exit $rc
