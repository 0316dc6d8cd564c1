#!/usr/bin/env bash
# Builds .devpack/ here: what a bare GPU machine with no internet lacks for the device scripts, packed
# small enough to travel with the working tree (the device tool carries at most 64 MiB in all).
#   site.tar.xz     nvidia-pytriton (tritonserver, Python backend, the stub for Python 3.12), tritonclient
#                   and the gRPC/JSON versions it needs; the OpenAI front end's Starlette, uvicorn, httptools, uvloop
#   numpy1.tar.xz   NumPy 1.26 for the Triton 2.51 Python backend stub, which dies under NumPy 2
#   load.tar.xz     locust and the parts of its dependencies the GPU image lacks
#   libpython3.12.so.1.0.xz   (optional) for the stub, where the image has no shared libpython
#   nvidia_cutlass-*.whl      CUTLASS headers for building the ATMM extension
# Wheels are read from WHEELS (default .whl) and downloaded for CPython 3.12 / manylinux x86-64 when missing.
# benchmarks/device_env.sh unpacks .devpack when it is present. Keep .devpack/ and .whl/ out of git
# (.git/info/exclude); carry .devpack in the device call: run(carry=[".devpack"], ...).
set -euo pipefail
cd "$(dirname "$0")/.."
WHEELS=${WHEELS:-.whl}
PACK=.devpack
mkdir -p "$WHEELS" "$PACK"
fetch() {  # fetch NAME==VERSION for CPython 3.12 on x86-64 unless a wheel of that name is there
  local norm
  norm=$(echo "${1%%==*}" | tr '.-' '__')
  ls "$WHEELS" | grep -iq "^${norm}-.*\.whl$" && return 0
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_35_x86_64 --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 --platform manylinux1_x86_64 -d "$WHEELS" "$1"
}
for w in nvidia-pytriton==0.7.0 tritonclient==2.73.0 numpy==1.26.4 nvidia-cutlass==4.2.0.0 locust==2.47.0 \
         gevent==26.9.0 geventhttpclient==2.6.1 greenlet==3.3.2 zope.event==6.2 zope.interface==8.7 \
         grpcio==1.85.1 protobuf==6.33.6 python-rapidjson==1.25 flask==3.1.3 flask-cors==6.0.5 flask-login==0.6.3 configargparse==1.9.0 pyzmq==27.3.0 brotli==1.2.1 \
         itsdangerous==2.2.0 blinker==1.9.0 bidict==0.24.1 python-engineio==4.15.1 python-socketio==5.18.1 \
         simple-websocket==1.1.0 websocket-client==1.9.2 wsproto==1.3.2 \
         starlette==1.10.0 anyio==4.16.0 sniffio==1.3.1 idna==3.20 uvicorn==0.54.0 h11==0.16.0 click==8.5.1 \
         httptools==0.9.0 uvloop==0.23.0; do
  fetch "$w"
done
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
unpack() {  # unpack the wheels matching the patterns into $tmp/$1 (a wheel is a zip of its install tree)
  local dir=$tmp/$1; shift
  mkdir -p "$dir"
  for pat in "$@"; do for w in "$WHEELS"/$pat; do
    # Unzip keeping the file modes (tritonserver and the backend stub must stay executable).
    python3 -c 'import os, sys, zipfile
z = zipfile.ZipFile(sys.argv[1])
for i in z.infolist():
    path = z.extract(i, sys.argv[2])
    mode = i.external_attr >> 16
    if mode and not i.is_dir():
        os.chmod(path, mode & 0o777)' "$w" "$dir"
  done; done
}
unpack site 'nvidia_pytriton-*.whl' 'tritonclient-*.whl' 'grpcio-*.whl' 'protobuf-*.whl' 'python_rapidjson-*.whl'
# The OpenAI front end (vlora.server.openai, benchmarks/openai_hop.py): Starlette on uvicorn, with httptools and uvloop.
unpack site 'starlette-*.whl' 'anyio-*.whl' 'sniffio-*.whl' 'idna-*.whl' 'uvicorn-*.whl' 'h11-*.whl' 'click-*.whl' \
  'httptools-*.whl' 'uvloop-*.whl'
# pytriton ships a stub per Python version: keep only the 3.12 one the GPU image runs.
find "$tmp/site/pytriton/tritonserver/python_backend_stubs" -mindepth 1 -maxdepth 1 ! -name 3.12 -exec rm -rf {} +
# ... and the libpython the other stubs link (32 MB for Python 3.13: without it the pack fits the carry).
find "$tmp/site/nvidia_pytriton.libs" -name 'libpython3-*' ! -name '*.12.so*' -delete
unpack numpy1 'numpy-1.*.whl'
unpack load 'locust-*.whl' 'gevent-*.whl' 'geventhttpclient-*.whl' 'greenlet-*.whl' 'zope_*.whl' 'flask*.whl' \
  'Flask*.whl' 'configargparse-*.whl' 'pyzmq-*.whl' 'brotli-*.whl' 'itsdangerous-*.whl' 'blinker-*.whl' \
  'bidict-*.whl' 'python_engineio-*.whl' 'python_socketio-*.whl' 'simple_websocket-*.whl' \
  'websocket_client-*.whl' 'wsproto-*.whl'
for part in site numpy1 load; do
  echo "packing $part ($(du -sh "$tmp/$part" | cut -f1))"
  tar -C "$tmp" -cJf "$PACK/$part.tar.xz" "$part"
done
cp "$WHEELS"/nvidia_cutlass-*.whl "$PACK/"
[ ! -f "$WHEELS/libpython3.12.so.1.0.xz" ] || cp "$WHEELS/libpython3.12.so.1.0.xz" "$PACK/"
du -sh "$PACK"
# What a device call can carry: the tracked tree travels too, and with the whole pack it can pass the 64 MiB limit
# (it did at 11 MB of tree). The pack's parts by need: site (always), numpy1 (the stub under NumPy 2), load (locust:
# load_device.sh only), the CUTLASS wheel (only until a call has built the ATMM extension: build_atmm.sh leaves
# vlora_atmm_ext*.so.gz and vlora_atmm_ext.src-sha256 in $OUT; copy both into .devpack/ and carry them instead: a
# prebuilt one whose src-sha256 does not match csrc/ is built again; keep $OUT to a few files, as the device tool
# brings back at most 8).
tree=$(git ls-files -z | du -cb --files0-from=- 2>/dev/null | tail -1 | cut -f1)
echo "tracked tree: $(( tree / 1048576 )) MiB; carry by name, e.g."
echo "  carry=[\".devpack/site.tar.xz\", \".devpack/numpy1.tar.xz\", \".devpack/$(cd "$PACK" && ls nvidia_cutlass-*.whl | head -1)\"]"
