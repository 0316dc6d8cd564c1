"""One Triton instance per GPU: the ATMM tuner sidecar an engine starts must profile that engine's GPU,
not device 0 of the host (what a child process sees by default). The environment it is started with is
tested in test_packaging.py (builder.child_env)."""
from __future__ import annotations

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
