# Sourced by the device scripts (device_serve.sh, load_device.sh, ...) on the GPU machine, from the
# repository root: installs what the machine lacks, makes this checkout importable by the Triton Python
# backend stub, and works around what that machine's image lacks. Two sources, either or both:
#   .devpack/  made here by benchmarks/make_devpack.sh (xz-packed, fits the device tool's 64 MiB carry)
#   WHEEL_DIRS (default ".whl"): plain wheels, installed with pip --no-index.
# A warm machine keeps /tmp between calls: start from a clean /tmp/site each time.
rm -rf /tmp/site /tmp/numpy1 /tmp/devpack-x && mkdir -p /tmp/site /tmp/devpack-x
for part in site load; do  # each archive holds one folder named after it
  [ ! -f ".devpack/$part.tar.xz" ] || { tar -C /tmp/devpack-x -xJf ".devpack/$part.tar.xz" && cp -a "/tmp/devpack-x/$part/." /tmp/site/; } || exit 1
done
rm -rf /tmp/devpack-x
[ ! -f .devpack/numpy1.tar.xz ] || tar -C /tmp -xJf .devpack/numpy1.tar.xz || exit 1
WHEELS=$(for d in ${WHEEL_DIRS:-.whl}; do ls "$d"/*.whl 2>/dev/null; done | grep -v '/numpy-')  # NumPy: below
if [ -n "$WHEELS" ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site $WHEELS || exit 1
fi
export PYTHONPATH=/tmp/site:${PYTHONPATH:-}
export PYTHONPATH=$PWD/backend:$PWD/client:$PWD/load:${PYTHONPATH:-}
export PYTHONUNBUFFERED=1
# The Python backend stub's interpreter ignores PYTHONPATH but reads site-packages: make this checkout
# importable there (what `pip install -e .` does, without needing a build backend on this machine).
SITE_PACKAGES=$(python3 -c 'import site; print(site.getsitepackages()[0])')
printf '%s\n%s\n%s\n' "$PWD/backend" "$PWD/client" "$PWD/load" > "$SITE_PACKAGES/vlora-checkout.pth"
# The Python backend stub of Triton 2.51 (nvidia-pytriton 0.7, which requires numpy<2) dies in
# deserialize_bytes_tensor under NumPy 2 (seen on this machine's image: "unpack_from requires a
# buffer of at least 1330597715 bytes"). Where the machine's NumPy is 2.x, put a carried NumPy 1.26
# first, and hide this image's scikit-learn/SciPy (built for NumPy 2, imported by transformers only
# when found) from find_spec. Benchmark-machine plumbing only; `pip install vlora[serve]` gets numpy<2.
NUMPY1=$(for d in ${WHEEL_DIRS:-.whl}; do ls "$d"/numpy-1.*.whl 2>/dev/null; done | head -1)
if python3 -c 'import numpy, sys; sys.exit(0 if numpy.__version__.startswith("2") else 1)' && [ -d /tmp/numpy1 -o -n "$NUMPY1" ]; then
  [ -d /tmp/numpy1 ] || python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/numpy1 "$NUMPY1"
  echo "import sys; sys.path.insert(0, '/tmp/numpy1'); import importlib.util as _u; _f = _u.find_spec; _u.find_spec = lambda n, p=None, _f=_f: None if n.split('.')[0] in ('sklearn', 'scipy') else _f(n, p)" > "$SITE_PACKAGES/0-vlora-numpy1.pth"
  python3 -c 'import numpy; print("numpy", numpy.__version__, "for the Triton Python backend")'
fi
# The Triton Python backend stub links libpython3.X.so; bring one where the system has none.
PYV=$(python3 -c 'import sys; print(f"{sys.version_info[0]}.{sys.version_info[1]}")')
LIBDIR=$(python3 -c 'import sysconfig; print(sysconfig.get_config_var("LIBDIR"))')
if [ ! -e "$LIBDIR/libpython$PYV.so.1.0" ] && ! ldconfig -p | grep -q "libpython$PYV.so.1.0"; then
  LIBPY=$(ls .devpack/libpython$PYV.so.1.0.xz .whl/libpython$PYV.so.1.0.xz 2>/dev/null | head -1)
  if [ -n "$LIBPY" ]; then
    mkdir -p /tmp/pylib && xz -dc "$LIBPY" > "/tmp/pylib/libpython$PYV.so.1.0"
    export LD_LIBRARY_PATH=/tmp/pylib:${LD_LIBRARY_PATH:-}
    echo "using carried libpython$PYV.so.1.0"
  else
    echo "warning: no libpython$PYV.so.1.0 for the Triton Python backend stub"
  fi
fi
# The ATMM extension is set up by benchmarks/build_atmm.sh, sourced after this file.
# Packs made before make_devpack.sh kept file modes: make the server and the stub executable.
chmod +x /tmp/site/pytriton/tritonserver/bin/* /tmp/site/pytriton/tritonserver/python_backend_stubs/*/triton_python_backend_stub 2>/dev/null || true
