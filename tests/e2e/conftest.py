"""End-to-end fixtures: a real tritonserver started by `vlora serve`, on free loopback ports, on the CPU.

The server uses the session's generated tiny model and demo adapters (see tests/conftest.py), so the
model is generated once per session and shared with the unit tests.
"""
from __future__ import annotations

import pytest

from e2e_helpers import start_server


@pytest.fixture(scope="session")
def server(tmp_path_factory, demo_adapter_root, vlora_cache):
    """The default server: tiny model, demo adapters, CPU."""
    ws = tmp_path_factory.mktemp("e2e-server")
    srv = start_server(ws, vlora_cache)  # finds the demo adapters generated in vlora_cache
    expected = sorted(p.name for p in demo_adapter_root.iterdir() if (p / "adapter_config.json").is_file())
    assert srv.adapters == expected, f"the launcher's banner lists {srv.adapters}, the adapter root has {expected}"
    yield srv
    code = srv.stop()
    assert code == 0, f"`vlora serve` did not stop cleanly (exit {code}):\n{srv.launcher_output()[-3000:]}"
