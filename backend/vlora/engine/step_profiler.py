"""A torch.profiler trace of the serving loop's steps (``engine.profile_dir``): what the server's steps spend,
on the engine thread and on the device, to set beside a benchmark's in-process profile of the same requests.

The profiler starts on the engine thread once ``skip`` steps have run something and stops ``count`` such steps
later; it records that thread's CPU ops and the device's kernels. Two files go to the folder:
``engine-steps-<pid>.json`` (a Chrome trace: chrome://tracing or Perfetto) and ``engine-steps-<pid>.txt`` (the
ops by self time on the device and on the CPU). The loop's other work (admission, adapter actions) between the
profiled steps is in the trace too; the idle waits between requests are not (the loop sleeps then).
"""
from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Optional

import torch

log = logging.getLogger(__name__)


class StepProfiler:
    """Profiles steps ``skip`` .. ``skip + count`` of the serving loop (counting steps that ran something)."""

    def __init__(self, out_dir: str, skip: int, count: int, device: torch.device) -> None:
        self.out_dir = Path(out_dir)
        self.skip, self.count = skip, count
        self.device = device
        self.steps = 0  # steps that ran something, since the loop started
        self.done = False
        self._prof: Optional[torch.profiler.profile] = None

    def before_step(self) -> None:
        if self.done or self._prof is not None or self.steps < self.skip:
            return
        from torch.profiler import ProfilerActivity, profile

        activities = [ProfilerActivity.CPU]
        if self.device.type == "cuda":
            activities.append(ProfilerActivity.CUDA)
        self._prof = profile(activities=activities)
        self._prof.__enter__()
        log.warning("engine.profile_dir: profiling %d steps of the engine loop", self.count)

    def after_step(self, ran: bool) -> None:
        if not ran:
            return
        self.steps += 1
        if self._prof is not None and self.steps >= self.skip + self.count:
            self.finish()

    def finish(self) -> Optional[Path]:
        """Stop and write the files (a loop that stops early writes what it has). The path of the trace, or None."""
        prof, self._prof = self._prof, None
        if prof is None or self.done:
            return None
        self.done = True
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        prof.__exit__(None, None, None)
        self.out_dir.mkdir(parents=True, exist_ok=True)
        stem = self.out_dir / f"engine-steps-{os.getpid()}"
        prof.export_chrome_trace(str(stem.with_suffix(".json")))
        averages = prof.key_averages()
        tables = [averages.table(sort_by="self_cpu_time_total", row_limit=40)]
        if self.device.type == "cuda":
            tables.insert(0, averages.table(sort_by="self_cuda_time_total", row_limit=40))
        stem.with_suffix(".txt").write_text("\n\n".join(tables) + "\n")
        log.warning("engine.profile_dir: wrote %s.json and .txt", stem)
        return stem.with_suffix(".json")
