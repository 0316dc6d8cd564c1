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


# -- the import graph, measured from the source ------------------------------------------------------------------
# Every import statement of every module of backend/vlora, client/vlora_client and load/vlora_load counts as an
# edge: at module level, inside functions and under TYPE_CHECKING alike (a lazy import still couples the two
# modules). An edge goes to the deepest module of ours the statement names (``from vlora.engine import gemv`` ->
# vlora.engine.gemv; ``from vlora.models.family import load_model`` -> vlora.models.family); relative imports are
# resolved; a package's own __init__, imported implicitly by its submodules, is not an edge.
ROOTS = {"vlora": REPO / "backend", "vlora_client": REPO / "client", "vlora_load": REPO / "load"}

# The packages from the bottom up. A module may import its own package and any package on a lower rank, never a
# higher one. Rank 0 are the leaves, which every package may import.
LAYERS = (
    ("vlora", "errors", "config", "metrics", "files"),  # leaves: error types, configuration, the metrics protocol, safe reads
    ("atmm",),  # the ATMM operator: knows nothing of adapters
    ("heads",),  # task heads, stored inside adapters
    ("lora",),  # adapters: format, residency, the LoRA layers and backends
    ("models",),  # model families and the tiny models (with their demo adapters)
    ("orchestrator",),  # modes, switcher, policies: consumes a cost model, drives nothing of the engine
    ("engine",),  # the serving engine; measures the cost model (engine/cost_probe.py)
    ("server",),  # the Triton model's helpers and the launcher
    ("fusion",),  # training: never imported to serve
    ("cli",),
    ("vlora_client",),
    ("vlora_load",),
)
RANK = {name: rank for rank, names in enumerate(LAYERS) for name in names}


def module_graph() -> dict[str, dict[str, int]]:
    """module -> {imported module of ours: line of the first such import}."""
    modules: dict[str, tuple[Path, bool]] = {}
    for top, root in ROOTS.items():
        for path in (root / top).rglob("*.py"):
            parts = list(path.relative_to(root).with_suffix("").parts)
            is_package = parts[-1] == "__init__"
            modules[".".join(parts[:-1] if is_package else parts)] = (path, is_package)

    def ours(name: str):
        while name and name not in modules:
            name = name.rpartition(".")[0]
        return name or None

    graph: dict[str, dict[str, int]] = {}
    for module, (path, is_package) in modules.items():
        edges = graph.setdefault(module, {})
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    package = module.split(".") if is_package else module.split(".")[:-1]
                    base = ".".join(package[:len(package) - node.level + 1] + ([node.module] if node.module else []))
                names = [f"{base}.{a.name}" for a in node.names]
            else:
                continue
            for name in names:
                target = ours(name)
                if target and target != module:
                    edges.setdefault(target, node.lineno)
    return graph


def package_of(module: str) -> str:
    """The layer a module belongs to: vlora's subpackage or top-level module, else the distribution's package."""
    parts = module.split(".")
    return parts[1] if parts[0] == "vlora" and len(parts) > 1 else parts[0]


def upward_imports(graph) -> list[str]:
    out = []
    for module, edges in sorted(graph.items()):
        for target, line in sorted(edges.items()):
            a, b = package_of(module), package_of(target)
            if a != b and RANK[b] > RANK[a]:
                out.append(f"{module}:{line} imports {target} ({a} is below {b})")
    return out


def import_cycles(graph) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), each a set of modules in a cycle."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    cycles: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph.get(v, {}):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                cycles.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return cycles


def test_every_package_has_a_layer():
    graph = module_graph()
    assert len(graph) > 80 and sum(map(len, graph.values())) > 150  # the walk found the code
    assert sorted({package_of(m) for m in graph} - set(RANK)) == []


def test_no_import_runs_from_a_lower_package_to_a_higher_one():
    assert upward_imports(module_graph()) == []


def test_no_import_cycles():
    assert import_cycles(module_graph()) == []


def test_the_checks_see_an_upward_import_and_a_cycle():
    graph = {"vlora.lora.manager": {"vlora.engine.metrics": 58}, "vlora.engine.metrics": {},
             "vlora_load.generators": {"vlora_load.workload": 26}, "vlora_load.workload": {"vlora_load.generators": 198}}
    assert upward_imports(graph) == ["vlora.lora.manager:58 imports vlora.engine.metrics (lora is below engine)"]
    assert import_cycles(graph) == [["vlora_load.generators", "vlora_load.workload"]]


if __name__ == "__main__":  # the structure facts docs/architecture.md quotes
    measured = module_graph()
    print(f"{len(measured)} modules, {sum(map(len, measured.values()))} import edges, "
          f"{len(upward_imports(measured))} upward imports, {len(import_cycles(measured))} import cycles")
    for line in upward_imports(measured):
        print("  upward:", line)
    for cycle in import_cycles(measured):
        print("  cycle:", " <-> ".join(cycle))
