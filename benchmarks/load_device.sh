#!/usr/bin/env bash
# Load tests on the GPU machine at LLaVA-1.5-7B width (random weights) with rank-64 adapters, through the
# same harness as the CPU (vlora loadtest / benchmarks/load_sweep.py) and a real tritonserver.
#
#   bash benchmarks/load_device.sh retrieval video  # average token latency against request rate (~4 min each)
#   SKEWNESS=0.2,0.5,0.9 OVERLOAD_S=20 bash ... # add a skewness sweep and an overload run (the CPU suite has them)
#   SCALING_GPUS="1 2 4" bash benchmarks/load_device.sh scaling  # throughput per GPU count (~3.5 min per count)
#       SCALING_DURATION (default 110 s of sending) and SCALING_WARMUP (default 40 s): the steady-state figures
#       count [warm-up, duration]; then the requests in flight drain (up to ~1 min at these output lengths).
#       SCALING_SERVE_ARGS: the server settings of these runs (default below).
#       SCALING_ADAPTERS (default 8): the adapters the requests spread over (issue 40's warm-adapter case: 32).
#       SCALING_ROUTING (default: vlora serve's default): routing modes to compare, each run per GPU count, e.g.
#       "off adapter" (--routing; results named load-7b-scaling-<n>gpu-routing-<mode>[-<k>ad]). One GPU never routes.
#   Issue 40's routing comparison (two device calls, ~10 min each on 4 H100s/H200s):
#     SCALING_ADAPTERS=32 SCALING_ROUTING="off adapter" SCALING_GPUS="4 1" SCALING_DURATION=60 SCALING_WARMUP=20 bash benchmarks/load_device.sh scaling
#     SCALING_ADAPTERS=32 SCALING_ROUTING="off adapter" SCALING_GPUS="2" SCALING_DURATION=60 SCALING_WARMUP=20 bash benchmarks/load_device.sh scaling
#
# Parts run in the order given. Both sweeps fit one 10-minute device command. Wheels the machine lacks are read from .whl/ (nvidia-pytriton,
# tritonclient, libpython, and NumPy 1 where the image has NumPy 2: see benchmarks/device_serve.sh) and from
# .work/whl-load/ (locust and its dependencies, about 9 MB, for the machine's Python 3.12), fetched here with:
#   pip download locust --only-binary=:all: --python-version 3.12 --platform manylinux_2_28_x86_64 \
#       --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 -d .work/whl-load
#   rm .work/whl-load/{pytest,pluggy,iniconfig,pygments}-*.whl     # .whl/ has what the tests use
# Or, smaller: .devpack/ (benchmarks/make_devpack.sh) holds all of it, xz-packed; carry only that.
# Writes $OUT/<part>.tgz (default OUT=benchmarks/load_results): each part's raw CSVs, summaries, plots
# and report, plus the results JSON and RESULTS.md lines (the device tool brings back few files); the
# scaling part also writes $OUT/scaling-<n>gpu.tgz as soon as each GPU count is done.
# Rebuild a report here with `vlora loadtest --report <folder>`.
# The machine setup is benchmarks/device_env.sh, shared with device_serve.sh.
set -uo pipefail
cd "$(dirname "$0")/.."
PARTS=("${@:-retrieval}")
OUT=${OUT:-benchmarks/load_results}
mkdir -p "$OUT"
WHEEL_DIRS="${WHEEL_DIRS:-.whl .work/whl-load}" source benchmarks/device_env.sh
PRESET=configs/models/llava-1.5-7b.yaml
# The random model (made on the GPU, written to disk) is generated while the extension builds (on the CPUs);
# load_sweep.py finds it there and makes it itself if this failed.
python3 -c "from vlora.models.random_init import make_random_llava as m; m('$PRESET', '/tmp/vlora-load/model-llava-1.5-7b')" \
  > /tmp/model-gen.log 2>&1 &
GEN=$!
source benchmarks/build_atmm.sh  # ATMM_EXT=off: the PyTorch reference
wait $GEN || { echo "model generation failed:"; tail -5 /tmp/model-gen.log; }
echo "[setup done at ${SECONDS} s]"
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
python3 -c 'import locust, gevent, tritonclient; print("locust", locust.__version__)' || exit 1

SERVER=(--device cuda --num-adapters 8 --adapter-rank 64 --image-size 336)
D=${LOAD_DURATION:-20}  # seconds per rate point
rc=0
for PART in "${PARTS[@]}"; do
  touch /tmp/load-part.start
  W=/tmp/load-out/$PART
  rm -rf "$W" && mkdir -p "$W"
  echo "== $PART"
  case "$PART" in
    retrieval)
      python3 -m benchmarks.load_sweep --keep-raw --name load-7b-retrieval --workload visual_retrieval --preset $PRESET \
        --rates ${RETRIEVAL_RATES:-0.25,0.5,1,2} --duration "$D" --skewness "${SKEWNESS:-}" --skew-duration "$D" --overload-duration "${OVERLOAD_S:-0}" \
        --out "$W/load-7b-retrieval" -- "${SERVER[@]}" --serve-arg="--max-queue-size 32" || rc=1 ;;
    video)
      # LLaVA-1.5 has a 4096-token context: 6 frames x 576 image tokens per action-recognition request.
      python3 -m benchmarks.load_sweep --keep-raw --name load-7b-video --workload video --preset $PRESET \
        --rates ${VIDEO_RATES:-1,2,4} --duration "$D" --skewness "${SKEWNESS:-}" --skew-duration "$D" --overload-duration "${OVERLOAD_S:-0}" \
        --out "$W/load-7b-video" -- "${SERVER[@]}" --frames-per-chunk 6 --serve-arg="--max-queue-size 32" || rc=1 ;;
    scaling)
      # One model instance per visible GPU (Triton's instance_group); closed loop, 32 users per GPU.
      # scheduler.max_waiting=2: an instance whose batch is full blocks in execute(), so Triton hands the next
      # request to another instance (with the default 64 one instance may hold far more than its batch while
      # another has room); atmm.tune_at_load=never: no tuner sidecar profiles on a GPU while it is measured.
      # With several GPUs, vlora serve routes by adapter unless --routing off (SCALING_ROUTING compares modes).
      NGPU=$(nvidia-smi -L | wc -l)
      ADS=${SCALING_ADAPTERS:-8}
      for n in ${SCALING_GPUS:-1 2 4}; do
        [ "$n" -le "$NGPU" ] || { echo "skipping $n GPUs: $NGPU here"; continue; }
        MODES=${SCALING_ROUTING:-default}
        [ "$n" -gt 1 ] || MODES=default  # one GPU: one model, whatever the mode
        for mode in $MODES; do
          NAME="load-7b-scaling-${n}gpu"; RARG=""
          [ "$mode" = default ] || { NAME="$NAME-routing-$mode"; RARG=" --routing $mode"; }
          [ "$ADS" = 8 ] || NAME="$NAME-${ADS}ad"
          echo "[${n} GPU(s), routing ${mode}, ${ADS} adapters from ${SECONDS} s]"
          CUDA_VISIBLE_DEVICES=$(seq -s, 0 $((n - 1))) python3 -m benchmarks.load_sweep --keep-raw --name "$NAME" \
            --workload visual_retrieval --preset $PRESET --closed-users $((32 * n)) --duration "${SCALING_DURATION:-110}" \
            --warmup-s "${SCALING_WARMUP:-40}" --out "$W/$NAME" -- "${SERVER[@]}" --num-adapters "$ADS" \
            --serve-arg="${SCALING_SERVE_ARGS:---set scheduler.max_waiting=2 --set atmm.tune_at_load=never}$RARG" || rc=1
          find benchmarks/results -name "$NAME-*.json" -newer /tmp/load-part.start -exec cp {} "$W/$NAME/" \;
          tar -C /tmp/load-out -czf "$OUT/scaling-${n}gpu-${mode}.tgz" "$PART/$NAME"  # kept if a later run is cut short
        done
      done ;;
    *) echo "usage: $0 retrieval|video|scaling ..."; exit 2 ;;
  esac
  find benchmarks/results -name 'load-7b-*.json' -newer /tmp/load-part.start -exec cp {} "$W/" \;
  tail -n 6 benchmarks/RESULTS.md > "$W/RESULTS-tail.md"
  cp /tmp/vlora-load/*.log "$W/" 2>/dev/null
  tar -C /tmp/load-out -czf "$OUT/$PART.tgz" "$PART"
done
exit $rc
