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
# The setup below follows benchmarks/device_serve.sh (keep them in step).
set -uo pipefail
cd "$(dirname "$0")/.."
PART=${1:-retrieval}
shift || true
OUT=${OUT:-benchmarks/load_results}
mkdir -p "$OUT"
WHEELS=$(ls .whl/*.whl .work/whl-load/*.whl 2>/dev/null | grep -v '/numpy-')  # NumPy is handled below
if [ -n "$WHEELS" ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site $WHEELS || exit 1
  export PYTHONPATH=/tmp/site:${PYTHONPATH:-}
fi
export PYTHONPATH=$PWD/backend:$PWD/client:${PYTHONPATH:-}
# The Triton Python backend stub reads site-packages, not PYTHONPATH: make this checkout importable there.
SITE_PACKAGES=$(python3 -c 'import site; print(site.getsitepackages()[0])')
printf '%s\n%s\n' "$PWD/backend" "$PWD/client" > "$SITE_PACKAGES/vlora-checkout.pth"
export PYTHONUNBUFFERED=1
# Triton 2.51's Python backend stub needs NumPy 1 (see device_serve.sh for the failure under NumPy 2).
NUMPY1=$(ls .whl/numpy-1.*.whl .work/whl-load/numpy-1.*.whl 2>/dev/null | head -1)
if python3 -c 'import numpy, sys; sys.exit(0 if numpy.__version__.startswith("2") else 1)' && [ -n "$NUMPY1" ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/numpy1 "$NUMPY1"
  echo "import sys; sys.path.insert(0, '/tmp/numpy1'); import importlib.util as _u; _f = _u.find_spec; _u.find_spec = lambda n, p=None, _f=_f: None if n.split('.')[0] in ('sklearn', 'scipy') else _f(n, p)" > "$SITE_PACKAGES/0-vlora-numpy1.pth"
fi
PYV=$(python3 -c 'import sys; print(f"{sys.version_info[0]}.{sys.version_info[1]}")')
LIBDIR=$(python3 -c 'import sysconfig; print(sysconfig.get_config_var("LIBDIR"))')
if [ ! -e "$LIBDIR/libpython$PYV.so.1.0" ] && ! ldconfig -p | grep -q "libpython$PYV.so.1.0"; then
  if [ -f ".whl/libpython$PYV.so.1.0.xz" ]; then
    mkdir -p /tmp/pylib && xz -dc ".whl/libpython$PYV.so.1.0.xz" > "/tmp/pylib/libpython$PYV.so.1.0"
    export LD_LIBRARY_PATH=/tmp/pylib:${LD_LIBRARY_PATH:-}
  fi
fi
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
