#!/usr/bin/env bash
# On the GPU machine, from the repository root: the GPU tests (engine parity and ATMM, with the ATMM
# extension active), then the serving decode benchmark through the real tritonserver at LLaVA-1.5-7B
# dimensions (random weights), the task-head latency, and the in-process engine decode rates.
# What the machine lacks comes from .devpack/ (benchmarks/make_devpack.sh) or .whl/: see device_env.sh;
# the ATMM extension from build_atmm.sh. Steps are skipped once less than their expected time is left
# of DEVICE_BUDGET_S (default 570 s), so a 10-minute device call always returns its logs.
#   STEPS="tests serve heads engine" (default all four); "openai": the OpenAI front end's hop against the generate
#   endpoint at the same dimensions (benchmarks/openai_hop.py, about 4 minutes; run it alone: STEPS=openai); "burst":
#   issue 36's rows through the server at the same dimensions (benchmarks/serve_burst.py: 32 new short prompts at once,
#   32 x 256 tokens base / resident / cold adapters, 64 new images at once; about 3 minutes, 4 with the model to write;
#   run it alone: STEPS=burst); "overhead": what the Triton path adds per request and per token over the in-process
#   engine, HTTP and gRPC at 1, 32 and 128 streams (benchmarks/server_overhead.py; run it alone: STEPS=overhead);
#   "burst-scaling": serve_burst on 1, 2 and 4 GPUs of this host (BURST_GPUS, default "1 4 2": the order they run in),
#   the load scaled with the GPUs (32 x n requests, 64 x n images), vlora serve's default routing (issue 40); each
#   count's JSON is copied to $OUT as soon as it is done (about 2, 4 and 3 minutes; run it alone on a 4-GPU machine),
#   after tests/gpu/test_routing_gpus.py on every GPU; "adapter-host" (after "burst"): a cold adapter's read and
#   staging with no server beside them, one at a time and four at once (benchmarks/host_transfers.py --only-adapters);
#   "apps": issue 35's applications through the server (benchmarks/vision_apps.py --part server), each model with
#   rates around their rates at the SLO with new content (every point draws new content since 0cf2101;
#   LLAVA_RATES / LLAVA_VIDEO_RATES, QWEN_RATES / QWEN_VIDEO_RATES; APPS_MODELS: which, default both; 3-5.5 minutes
#   a model on a fresh machine, so usually one model a call; run it alone: STEPS=apps; it needs .devpack/load.tar.xz
#   carried, for locust)
# Writes under $OUT (default benchmarks/device_out): log.txt (every step's output), bundle.tgz (server logs,
# the results JSON and RESULTS.md lines this run wrote), and the built extension (few files: the device
# tool brings back at most 8).
set -uo pipefail
cd "$(dirname "$0")/.."
T0=$(date +%s)
OUT=${OUT:-benchmarks/device_out}
mkdir -p "$OUT"
LOG=$OUT/log.txt
touch /tmp/device-serve.start
exec > >(tee -a "$LOG") 2>&1
STEPS=${STEPS:-"tests serve heads engine"}
source benchmarks/device_env.sh
source benchmarks/build_atmm.sh
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
df -h /dev/shm | tail -1  # Triton's Python backend passes requests and responses through it
python3 -c 'import torch, transformers; print("torch", torch.__version__, "transformers", transformers.__version__)'
want() {  # want STEP SECONDS: the step is asked for and about SECONDS are left
  [[ " $STEPS " == *" $1 "* ]] || return 1
  local left=$(( ${DEVICE_BUDGET_S:-570} - ($(date +%s) - T0) ))
  [ "$left" -ge "$2" ] || { echo "skipping $1: ${left} s left"; return 1; }
  echo "== $1 ($(( $(date +%s) - T0 )) s in)"
}
rc=0
if want tests 120; then
  timeout 240 python3 -m pytest -q -x -p no:cacheprovider tests/gpu 2>&1 | tail -15 || rc=1
fi
if want serve 150; then
  python3 -m benchmarks.serve_decode --preset configs/models/llava-1.5-7b.yaml --work /tmp/vlora-bench "$@" || rc=1
fi
if want heads 90; then
  python3 -m benchmarks.heads_latency --preset configs/models/llava-1.5-7b.yaml --work /tmp/vlora-heads --device cuda \
    --json-out /tmp/heads-latency.json || rc=1
fi
if want engine 90; then
  python3 -m benchmarks.engine_decode --work /tmp/vlora-bench || rc=1
fi
if want openai 240; then
  python3 -m benchmarks.openai_hop --device cuda --preset configs/models/llava-1.5-7b.yaml --work /tmp/vlora-bench || rc=1
fi
if want burst 240; then
  python3 -m benchmarks.serve_burst --preset configs/models/llava-1.5-7b.yaml --work /tmp/vlora-bench || rc=1
fi
if want adapter-host 60; then  # after burst: its adapters and model are on disk
  timeout 120 python3 -m benchmarks.host_transfers --only-adapters --adapters /tmp/vlora-bench/burst-adapters-r64/served \
    --model /tmp/vlora-bench/llava-1.5-7b || rc=1
fi
if want burst-scaling 200; then
  # The router on every GPU of the host first (a hang fails it with the server's log within 2 minutes).
  timeout 240 python3 -m pytest -q -x -p no:cacheprovider tests/gpu/test_routing_gpus.py 2>&1 | tail -30 || rc=1
  for n in ${BURST_GPUS:-1 4 2}; do
    want burst-scaling 150 || break
    # A hang: SIGUSR1 makes serve_burst print every thread's stack (then it is killed 20 s later).
    CUDA_VISIBLE_DEVICES=$(seq -s, 0 $((n - 1))) timeout -s USR1 -k 20 280 python3 -m benchmarks.serve_burst \
      --preset configs/models/llava-1.5-7b.yaml --work /tmp/vlora-bench --requests $((32 * n)) --images $((64 * n)) || rc=1
    cp benchmarks/results/serve-burst-*.json "$OUT/serve-burst-${n}gpu.json" 2>/dev/null
    mkdir -p /tmp/bundle
    tail -c 200000 /tmp/vlora-bench/burst-server/ws/tritonserver.log > "/tmp/bundle/burst-${n}gpu-tritonserver.log" 2>/dev/null
  done
fi
if want overhead 240; then
  python3 -m benchmarks.server_overhead --device cuda --preset configs/models/llava-1.5-7b.yaml --work /tmp/vlora-bench || rc=1
fi
apps() {  # apps MODEL RETRIEVAL_RATES VIDEO_RATES: at most 340 s, and never past the budget
  local left=$(( ${DEVICE_BUDGET_S:-570} - ($(date +%s) - T0) - 5 ))
  timeout $(( left < 340 ? left : 340 )) python3 -m benchmarks.vision_apps --part server --presets "configs/models/$1.yaml" \
    --rates "$2" --video-rates "$3" --duration 15 --reps 4 --work /tmp/vlora-bench || rc=1
}
# On a fresh machine LLaVA's step takes 300-320 s (its 7B model is written first, ~100 s) and Qwen's 190-260 s: both
# rarely fit one 10-minute call; APPS_MODELS picks (default both, in this order; a model without the time is skipped).
for m in ${APPS_MODELS:-llava-1.5-7b qwen2-vl-7b}; do
  want apps 200 || continue
  case $m in
    llava*) apps "$m" "${LLAVA_RATES:-8,10,12}" "${LLAVA_VIDEO_RATES:-12,14,16}" ;;
    *) apps "$m" "${QWEN_RATES:-12,14,16}" "${QWEN_VIDEO_RATES:-40,44,48}" ;;
  esac
done
mkdir -p /tmp/bundle
cp /tmp/vlora-bench/server.log /tmp/bundle/ 2>/dev/null
tail -c 300000 /tmp/vlora-bench/triton-ws/tritonserver.log > /tmp/bundle/tritonserver.log 2>/dev/null
tail -c 300000 /tmp/vlora-bench/burst-server/ws/tritonserver.log > /tmp/bundle/burst-tritonserver.log 2>/dev/null
tail -n 8 benchmarks/RESULTS.md > /tmp/bundle/RESULTS-tail.md
find benchmarks/results -name '*.json' -newer /tmp/device-serve.start -exec cp {} /tmp/bundle/ \;
cp /tmp/heads-latency.json /tmp/bundle/ 2>/dev/null
tar -C /tmp -czf "$OUT/bundle.tgz" bundle
echo "done in $(( $(date +%s) - T0 )) s"
exit $rc
