#!/usr/bin/env bash
# On the GPU machine, from the repository root: the engine's GPU tests, then the serving decode
# benchmark through the real tritonserver at LLaVA-1.5-7B dimensions (random weights).
# Wheels that the machine lacks (nvidia-pytriton, peft, pytest) are read from .whl/ when present.
# Writes logs and results under $OUT (or benchmarks/results when OUT is unset).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-benchmarks/results}
mkdir -p "$OUT"
WHEELS=$(ls .whl/*.whl 2>/dev/null | grep -v '/numpy-')  # NumPy is handled below
if [ -n "$WHEELS" ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site $WHEELS || exit 1
  export PYTHONPATH=/tmp/site:${PYTHONPATH:-}
fi
export PYTHONPATH=$PWD/backend:$PWD/client:${PYTHONPATH:-}
# The Python backend stub's interpreter ignores PYTHONPATH but reads site-packages: make this checkout
# importable there (what `pip install -e .` does, without needing a build backend on this machine).
SITE_PACKAGES=$(python3 -c 'import site; print(site.getsitepackages()[0])')
printf '%s\n%s\n' "$PWD/backend" "$PWD/client" > "$SITE_PACKAGES/vlora-checkout.pth"
export PYTHONUNBUFFERED=1
# The Python backend stub of Triton 2.51 (nvidia-pytriton 0.7, which requires numpy<2) dies in
# deserialize_bytes_tensor under NumPy 2 (seen on this machine's image: "unpack_from requires a
# buffer of at least 1330597715 bytes"). Where the machine's NumPy is 2.x, put a carried NumPy 1.26
# first, and hide this image's scikit-learn/SciPy (built for NumPy 2, imported by transformers only
# when found) from find_spec. Benchmark-machine plumbing only; `pip install vlora[serve]` gets numpy<2.
if python3 -c 'import numpy, sys; sys.exit(0 if numpy.__version__.startswith("2") else 1)' && ls .whl/numpy-1.*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/numpy1 .whl/numpy-1.*.whl
  echo "import sys; sys.path.insert(0, '/tmp/numpy1'); import importlib.util as _u; _f = _u.find_spec; _u.find_spec = lambda n, p=None, _f=_f: None if n.split('.')[0] in ('sklearn', 'scipy') else _f(n, p)" > "$SITE_PACKAGES/0-vlora-numpy1.pth"
  python3 -c 'import numpy, transformers; from transformers import LlavaForConditionalGeneration; print("numpy", numpy.__version__, "for the Triton Python backend")'
fi
# The Triton Python backend stub links libpython3.X.so; bring one where the system has none.
PYV=$(python3 -c 'import sys; print(f"{sys.version_info[0]}.{sys.version_info[1]}")')
LIBDIR=$(python3 -c 'import sysconfig; print(sysconfig.get_config_var("LIBDIR"))')
if [ ! -e "$LIBDIR/libpython$PYV.so.1.0" ] && ! ldconfig -p | grep -q "libpython$PYV.so.1.0"; then
  if [ -f ".whl/libpython$PYV.so.1.0.xz" ]; then
    mkdir -p /tmp/pylib && xz -dc ".whl/libpython$PYV.so.1.0.xz" > "/tmp/pylib/libpython$PYV.so.1.0"
    export LD_LIBRARY_PATH=/tmp/pylib:${LD_LIBRARY_PATH:-}
    echo "using carried libpython$PYV.so.1.0"
  else
    echo "warning: no libpython$PYV.so.1.0 for the Triton Python backend stub"
  fi
fi
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
python3 -c 'import torch, transformers; print("torch", torch.__version__, "transformers", transformers.__version__)'
rc=0
[ -n "${SKIP_GPU_TESTS:-}" ] || python3 -m pytest -q -p no:cacheprovider tests/gpu 2>&1 | tee "$OUT/gpu-tests.log" || rc=1
python3 benchmarks/serve_decode.py --preset configs/models/llava-1.5-7b.yaml --work /tmp/vlora-bench "$@" 2>&1 | tee "$OUT/serve-decode.log" || rc=1
cp /tmp/vlora-bench/server.log "$OUT/server.log" 2>/dev/null
tail -c 200000 /tmp/vlora-bench/triton-ws/tritonserver.log > "$OUT/tritonserver.log" 2>/dev/null
python3 benchmarks/engine_decode.py --work /tmp/vlora-bench 2>&1 | tee "$OUT/engine-decode.log" || rc=1
[ -z "${PROFILE:-}" ] || python3 benchmarks/profile_step.py --work /tmp/vlora-bench 2>&1 | tee "$OUT/profile.log"
cp benchmarks/results/serve-decode-*.json benchmarks/results/engine-decode-*.json "$OUT/" 2>/dev/null
tail -n 3 benchmarks/RESULTS.md > "$OUT/RESULTS-lines.md" 2>/dev/null
exit $rc
