# vlora: the two commands are `make serve` and `make test`. Both set up .venv first (Python 3.11 + pip).
PYTHON ?= python3.11
VENV ?= .venv
# torch first and pinned: 2.13.0 has a CPU wheel on the CI and developer machines; an unpinned torch
# would pull the newest CUDA build (several GB). On a CUDA machine the same pin gives the CUDA wheel.
TORCH_SPEC ?= torch==2.13.0
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
SERVE_ARGS ?=
PYTEST_ARGS ?=

.PHONY: setup serve test test-kernels test-e2e doctor atmm-ext clean

setup: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet "$(TORCH_SPEC)"
	$(PY) -m pip install --quiet -e ".[serve,dev]"
	touch $(STAMP)

# Serve the default model (the embedded tiny random model and its demo adapters) on ports 8000-8002.
# Other settings: make serve SERVE_ARGS="--model /models/llava-1.5-7b-hf --adapters /adapters --device cuda"
serve: setup
	$(VENV)/bin/vlora serve $(SERVE_ARGS)

# Every CPU test, the end-to-end ones against a real tritonserver included; GPU tests skip here. Then the
# Triton-language kernels' tests (marker `interpreter`) in a pytest run of their own under Triton's
# interpreter: the kernel modules read TRITON_INTERPRET when imported.
test: setup
	$(PY) -m pytest tests -q -rs --durations=15 -m "not interpreter" $(PYTEST_ARGS)
	$(MAKE) --no-print-directory test-kernels

test-kernels: setup
	TRITON_INTERPRET=1 $(PY) -m pytest tests/unit -q -rs --durations=5 -m interpreter $(PYTEST_ARGS)

test-e2e: setup
	$(PY) -m pytest tests/e2e -q -rs --durations=15 $(PYTEST_ARGS)

doctor: setup
	$(VENV)/bin/vlora doctor

# On a CUDA machine: build the ATMM extension (CUTLASS headers from the nvidia-cutlass wheel).
# ATMM_CUDA_ARCHS: 90a for H100/H200, 80 for A100, "80;90a" for both. CI never builds it.
ATMM_CUDA_ARCHS ?= 90a
atmm-ext: setup
	$(PY) -m pip install --quiet --no-deps nvidia-cutlass==4.2.0.0
	$(PY) -m pip install --quiet pybind11 scikit-build-core
	ATMM_CUDA_ARCHS="$(ATMM_CUDA_ARCHS)" $(PY) -m pip install --no-build-isolation ./csrc

clean:
	rm -rf $(VENV) .pytest_cache
