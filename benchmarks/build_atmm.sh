#!/usr/bin/env bash
# Sourced by the device scripts after benchmarks/device_env.sh: makes the ATMM extension importable, by
# the scripts and by the Triton Python backend stub (through a .pth), in /tmp/atmm-ext.
#   - a prebuilt one carried in .devpack/vlora_atmm_ext*.so.gz (from an earlier call's $OUT) is used when
#     .devpack/vlora_atmm_ext.src-sha256 beside it names the same csrc/ as this checkout's (a stale one is
#     rebuilt, saying so);
#   - else it is built here from csrc/ with the CUTLASS wheel in .devpack/ or .whl/ (about a minute or
#     two on 16 cores), and a gzipped copy and its src-sha256 are left in $OUT for the next call to carry.
# ATMM_EXT=off skips it all (the PyTorch reference then serves every LoRA computation).
[ "${ATMM_EXT:-auto}" != off ] || return 0
rm -rf /tmp/atmm-ext && mkdir -p /tmp/atmm-ext
ATMM_SRC_SHA=$(find csrc -type f ! -name '*.pyc' ! -path '*/__pycache__/*' ! -name '*.md' | LC_ALL=C sort | xargs cat | sha256sum | cut -c1-64)
PREBUILT=$(ls .devpack/vlora_atmm_ext*.so.gz 2>/dev/null | head -1)
if [ -n "$PREBUILT" ] && [ "$(cat .devpack/vlora_atmm_ext.src-sha256 2>/dev/null)" != "$ATMM_SRC_SHA" ]; then
  echo "ATMM extension: the carried $(basename "$PREBUILT") was built from other csrc/ sources; building it again"
  PREBUILT=
fi
if [ -n "$PREBUILT" ]; then
  gzip -dc "$PREBUILT" > "/tmp/atmm-ext/$(basename "${PREBUILT%.gz}")"
  echo "ATMM extension: carried $(basename "$PREBUILT")"
else
  CUTLASS_WHL=$(ls .devpack/nvidia_cutlass-*.whl .whl/nvidia_cutlass-*.whl 2>/dev/null | head -1)
  if [ -z "$CUTLASS_WHL" ] && ! python3 -c 'import cutlass_library' 2>/dev/null; then
    echo "ATMM extension: no CUTLASS headers here; the PyTorch reference serves"; return 0
  fi
  [ -z "$CUTLASS_WHL" ] || python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site "$CUTLASS_WHL"
  t0=$(date +%s)
  if cmake -S csrc -B /tmp/atmm-build -DCMAKE_BUILD_TYPE=Release -DPython_EXECUTABLE="$(command -v python3)" \
        -DATMM_CUDA_ARCHS="${ATMM_CUDA_ARCHS:-90a}" > /tmp/atmm-build.log 2>&1 &&
     cmake --build /tmp/atmm-build -j "$(nproc)" >> /tmp/atmm-build.log 2>&1; then
    cp /tmp/atmm-build/vlora_atmm_ext*.so /tmp/atmm-ext/
    so=$(basename /tmp/atmm-ext/vlora_atmm_ext*.so)
    [ -z "${OUT:-}" ] || { gzip -c "/tmp/atmm-ext/$so" > "$OUT/$so.gz"; echo "$ATMM_SRC_SHA" > "$OUT/vlora_atmm_ext.src-sha256"; }
    echo "ATMM extension: built in $(( $(date +%s) - t0 )) s"
  else
    tail -30 /tmp/atmm-build.log; echo "ATMM extension: build FAILED; the PyTorch reference serves"; return 0
  fi
fi
export PYTHONPATH=/tmp/atmm-ext:$PYTHONPATH
echo /tmp/atmm-ext > "$(python3 -c 'import site; print(site.getsitepackages()[0])')/vlora-atmm-ext.pth"
python3 -c 'from vlora.atmm.doctor import doctor_report as r; print(r())' 2>&1 | tail -8
