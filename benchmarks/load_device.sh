#!/usr/bin/env bash
# Load tests on the GPU machine at LLaVA-1.5-7B width (random weights) with rank-64 adapters, through the
# same harness as the CPU (vlora loadtest / benchmarks/load_sweep.py) and a real tritonserver.
#
#   bash benchmarks/load_device.sh retrieval   # visual retrieval: rate sweep, skewness sweep, overload (~8 min)
#   bash benchmarks/load_device.sh video       # video analytics: rate sweep (chunks/s), skewness, overload (~7 min)
#   bash benchmarks/load_device.sh scaling 1 2 # throughput at 1 and 2 GPUs, one instance per GPU (~3-4 min per count)
#   bash benchmarks/load_device.sh scaling 4   # ... and at 4 (an nvidia-h200-x4 machine)
#
# Each part fits one 10-minute device command. Wheels the machine lacks are read from .whl/ (nvidia-pytriton,
# tritonclient, libpython, and NumPy 1 where the image has NumPy 2: see benchmarks/device_serve.sh) and from
# .work/whl-load/ (locust and its dependencies, about 9 MB, for the machine's Python 3.12), fetched here with:
#   pip download locust --only-binary=:all: --python-version 3.12 --platform manylinux_2_28_x86_64 \
#       --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 -d .work/whl-load
#   rm .work/whl-load/{pytest,pluggy,iniconfig,pygments}-*.whl     # .whl/ has what the tests use
# Carry both folders (run(carry=[".whl", ".work/whl-load"], ...)). If that is over the 64 MiB carry limit
# (.whl with a NumPy wheel is close to it), carry .whl in one call and .work/whl-load in the next one on the
# same warm machine: paths not named in carry stay where the previous call left them.
# matplotlib is not carried: the reports come back without plots; rebuild them here with
#   vlora loadtest --report <fetched folder>
# Writes under $OUT (default benchmarks/load_results): the raw CSVs, summaries and reports.
# The machine setup is benchmarks/device_env.sh, shared with device_serve.sh.
set -uo pipefail
cd "$(dirname "$0")/.."
PART=${1:-retrieval}
shift || true
OUT=${OUT:-benchmarks/load_results}
mkdir -p "$OUT"
WHEEL_DIRS=".whl .work/whl-load" source benchmarks/device_env.sh
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
python3 -c 'import locust, gevent, tritonclient; print("locust", locust.__version__)' || exit 1

PRESET=configs/models/llava-1.5-7b.yaml
SERVER=(--device cuda --num-adapters 8 --adapter-rank 64 --image-size 336)
rc=0
case "$PART" in
  retrieval)
    python3 benchmarks/load_sweep.py --keep-raw --name load-7b-retrieval --workload visual_retrieval --preset $PRESET \
      --rates 2,4,6,8 --duration 30 --skewness 0.2,0.5,0.9 --skew-duration 20 --overload-duration 30 \
      --out "$OUT/load-7b-retrieval" -- "${SERVER[@]}" --serve-arg="--max-queue-size 32" || rc=1 ;;
  video)
    # LLaVA-1.5 has a 4096-token context: 6 frames x 576 image tokens per action-recognition request.
    python3 benchmarks/load_sweep.py --keep-raw --name load-7b-video --workload video --preset $PRESET \
      --rates 2,4,8,12 --duration 30 --skewness 0.2,0.5,0.9 --skew-duration 20 --overload-duration 30 \
      --out "$OUT/load-7b-video" -- "${SERVER[@]}" --frames-per-chunk 6 --serve-arg="--max-queue-size 32" || rc=1 ;;
  scaling)
    # One model instance per visible GPU (Triton's instance_group); closed loop, 32 users per GPU.
    NGPU=$(nvidia-smi -L | wc -l)
    for n in ${@:-1 2 4}; do
      [ "$n" -le "$NGPU" ] || continue
      CUDA_VISIBLE_DEVICES=$(seq -s, 0 $((n - 1))) python3 benchmarks/load_sweep.py --keep-raw --name "load-7b-scaling-${n}gpu" \
        --workload visual_retrieval --preset $PRESET --closed-users $((32 * n)) --duration 45 \
        --out "$OUT/load-7b-scaling-${n}gpu" -- "${SERVER[@]}" || rc=1
    done ;;
  *) echo "usage: $0 retrieval|video|scaling"; exit 2 ;;
esac
cp benchmarks/results/load-7b-*.json "$OUT/" 2>/dev/null
tail -n 4 benchmarks/RESULTS.md > "$OUT/RESULTS-lines.md" 2>/dev/null
exit $rc
