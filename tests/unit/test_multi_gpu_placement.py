"""One Triton instance per GPU: the ATMM tuner sidecar an engine starts must profile that engine's GPU,
not device 0 of the host (what a child process sees by default)."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

from vlora.engine import builder


@pytest.mark.parametrize("index, visible, expected", [
    (0, None, "0"),
    (3, None, "3"),
    (1, "0,1", "1"),
    (1, "4, 6", "6"),  # this process sees physical GPUs 4 and 6: its device 1 is GPU 6
    (0, "GPU-aaaa,GPU-bbbb", "GPU-aaaa"),
    (2, "0,1", None),  # cannot be told: leave the environment alone
])
def test_visible_devices_for_child(index, visible, expected):
    assert builder.visible_devices_for_child(index, visible) == expected


def _child_sees() -> str:
    code = "import os; print(os.environ.get('CUDA_VISIBLE_DEVICES', '<unset>'))"
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip()


def test_child_started_inside_sees_only_the_engine_gpu_and_the_environment_is_restored(monkeypatch):
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    with builder._child_sees_only(1):
        assert _child_sees() == "1"
    assert "CUDA_VISIBLE_DEVICES" not in os.environ

    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "2,5")
    with builder._child_sees_only(1):
        assert _child_sees() == "5"
    assert os.environ["CUDA_VISIBLE_DEVICES"] == "2,5"

    with builder._child_sees_only(None):  # a CPU engine: nothing changes
        assert _child_sees() == "2,5"
