"""Issue 37: `vlora serve --set KEY=VALUE` with a value of the wrong kind for a number key is one line naming
the key, not a Python traceback (as text keys already were)."""
from __future__ import annotations

import subprocess
import sys

import pytest

from vlora.config import ConfigError, EngineConfig


@pytest.mark.parametrize("setting,message", [
    ("scheduler.max_waiting=abc", "scheduler.max_waiting must be an integer, got 'abc'"),
    ("scheduler.admission_timeout_s=soon", "scheduler.admission_timeout_s must be a number, got 'soon'"),
    ("cache.num_blocks=[1, 2]", "cache.num_blocks must be an integer, got [1, 2]"),
    ("limits.max_inflight_image_bytes=lots", "limits.max_inflight_image_bytes must be an integer, got 'lots'"),
    ("lora.max_rank=true", "lora.max_rank must be an integer, got True"),
])
def test_a_non_number_for_a_number_key_names_the_key(setting, message):
    key, _, value = setting.partition("=")
    with pytest.raises(ConfigError) as e:
        EngineConfig().with_overrides({key: value})
    assert str(e.value) == message


def test_numbers_and_nulls_still_work():
    config = EngineConfig().with_overrides({"scheduler.max_waiting": "8", "scheduler.admission_timeout_s": "2",
                                            "cache.num_blocks": "", "limits.max_inflight_image_bytes": "1048576"})
    assert config.scheduler.max_waiting == 8 and config.scheduler.admission_timeout_s == 2
    assert config.cache.num_blocks is None and config.limits.max_inflight_image_bytes == 1 << 20


def test_the_cli_prints_one_line_and_no_traceback(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "vlora.cli", "serve", "--workspace", str(tmp_path / "ws"),
                           "--set", "scheduler.max_waiting=abc"], capture_output=True, text=True, timeout=120)
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0
    assert "Traceback" not in out, out
    assert "scheduler.max_waiting must be an integer, got 'abc'" in out, out
    assert len([line for line in out.splitlines() if "max_waiting" in line]) == 1, out
