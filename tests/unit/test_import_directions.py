"""Imports run one way (../shared/STYLE.md): kernels know nothing of adapters, error types sit in a leaf module,
and serving never imports training or load-test code. The imports run in a fresh interpreter, so what a
module pulls in is not hidden by what this test session imported before; the source checks read the files."""
from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
PACKAGE = REPO / "backend" / "vlora"
MODEL_PY = REPO / "model_repository" / "vlora" / "1" / "model.py"
ERROR_TYPES = {"InvalidRequest", "EngineOverloaded", "EngineDead"}


# One fresh interpreter, three stages; after each, the vlora, vlora_load, vlora_client and peft modules loaded so far.
# The stages build on each other (one interpreter: torch and transformers are imported once).
STAGED = """
import importlib.util, json, sys, time

def loaded():
    return sorted(m for m in sys.modules if m.split(".")[0] in ("vlora", "vlora_load", "vlora_client", "peft"))

stages = {{}}
import vlora.errors
stages["errors"] = loaded()
import vlora.atmm, vlora.atmm.dispatch, vlora.atmm.reference, vlora.atmm.cases, vlora.atmm.tuner
import vlora.atmm.tiling, vlora.atmm.merge, vlora.atmm.doctor
stages["atmm"] = loaded()

# The serve path: model.py as Triton runs it (with a fake pb_utils). initialize builds the engine on the tiny
# model with its demo adapters, one request to a trained demo adapter is answered, finalize drains.
sys.path.insert(0, {tests!r})
from fake_pb_utils import FakeRequest, fake_pb_utils
sys.modules["triton_python_backend_utils"] = pb = fake_pb_utils()
spec = importlib.util.spec_from_file_location("vlora_triton_model", {model_py!r})
model = sys.modules["vlora_triton_model"] = importlib.util.module_from_spec(spec)
spec.loader.exec_module(model)
params = {{"model.cache_dir": {cache!r}, "model.device": "cpu"}}
config = {{"model_transaction_policy": {{"decoupled": True}},
           "parameters": {{k: {{"string_value": v}} for k, v in params.items()}}}}
m = model.TritonPythonModel()
m.initialize({{"model_config": json.dumps(config), "model_name": "vlora", "model_version": "1"}})
request = FakeRequest({{"text_input": "USER: hello ASSISTANT:"}}, {{"max_tokens": 2, "lora_name": "demo-shapes"}})
m.execute([request])
deadline = time.monotonic() + 60
while not any(flags for _, flags in request.sender.sent) and time.monotonic() < deadline:
    time.sleep(0.05)
m.finalize()
response = request.sender.final
assert not response.has_error(), response.error().message()
assert response.text("num_output_tokens") == 2, response.text("num_output_tokens")
stages["serve"] = loaded()
print(json.dumps(stages))
"""


@pytest.fixture(scope="module")
def loaded(tiny_model_dir, demo_adapter_root, vlora_cache) -> dict[str, list[str]]:
    code = STAGED.format(tests=str(REPO / "tests"), model_py=str(MODEL_PY), cache=str(vlora_cache))
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, cwd=REPO)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_the_error_types_are_a_leaf(loaded):
    assert loaded["errors"] == ["vlora", "vlora.errors"]


def test_atmm_imports_nothing_from_lora_or_the_engine(loaded):
    added = sorted(set(loaded["atmm"]) - set(loaded["errors"]))
    assert "vlora.atmm.tuner" in added
    assert [m for m in added if not m.startswith("vlora.atmm")] == []


def test_the_serve_path_imports_no_training_or_load_test_code(loaded):
    """Nothing of vlora.fusion (training), PEFT, the load tests or the client is imported to serve."""
    modules = loaded["serve"]
    assert "vlora.server.wire" in modules and "vlora.lora.demo" in modules  # the path this test means ran
    assert [m for m in modules if m.startswith(("vlora.fusion", "vlora_load", "vlora_client", "peft"))] == []


def _imports(path: Path):
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.ImportFrom) and node.module:
            yield node.module, {a.name for a in node.names}
        elif isinstance(node, ast.Import):
            for a in node.names:
                yield a.name, set()


def test_no_package_imports_the_engine_for_error_types():
    offenders = []
    for path in sorted(PACKAGE.rglob("*.py")) + [MODEL_PY]:
        if PACKAGE / "engine" in path.parents:
            continue  # the engine's own modules may use its public contract
        for module, names in _imports(path):
            if module.startswith("vlora.engine") and names & ERROR_TYPES:
                offenders.append(f"{path.relative_to(REPO)}: from {module} import {sorted(names & ERROR_TYPES)}")
    assert offenders == [], "import the error types from vlora.errors:\n" + "\n".join(offenders)


def test_the_server_package_does_not_import_the_load_tests_or_the_client():
    offenders = [f"{path.relative_to(REPO)}: {module}" for path in sorted(PACKAGE.rglob("*.py"))
                 for module, _ in _imports(path) if module.split(".")[0] in ("vlora_load", "vlora_client")]
    assert offenders == []
