"""CPU use of the processes in a load test, to tell what bounds a run: the load generator (locust and its
gRPC worker), Triton's front end (``tritonserver``) or the model instances (one Python backend stub each).

:class:`CpuSampler` reads each matching process's user + system CPU time (psutil, which locust brings)
while the run goes; :meth:`CpuSampler.cores` gives, per role, the cores used on average between the first
and the last sample, and the busiest single process of the role (a Python process near 1.0 core is bound
by its interpreter lock).
"""
from __future__ import annotations

import time
from typing import Optional

CPU_FILE = "process_cpu.json"
ROLES = (  # (role, what its command line holds)
    ("grpc_worker", "vlora_load.grpc_worker"),
    ("locust", "locust"),
    ("stub", "triton_python_backend_stub"),
    ("tritonserver", "tritonserver"),
)


def role_of(cmdline: list[str]) -> Optional[str]:
    text = " ".join(cmdline)
    for role, marker in ROLES:
        if marker in text:
            return role
    return None


class CpuSampler:
    """Samples the CPU time of every process whose command line names a role (see ``ROLES``)."""

    def __init__(self) -> None:
        try:
            import psutil
        except ImportError:  # pragma: no cover - psutil comes with locust
            psutil = None
        self._psutil = psutil
        self.first: Optional[tuple[float, dict]] = None
        self.last: Optional[tuple[float, dict]] = None

    def sample(self) -> None:
        if self._psutil is None:
            return
        times: dict[int, tuple[str, float]] = {}
        for p in self._psutil.process_iter(["pid", "cmdline", "cpu_times"]):
            try:
                role = role_of(p.info["cmdline"] or [])
                ct = p.info["cpu_times"]
            except (self._psutil.Error, TypeError):
                continue
            if role is not None and ct is not None:
                times[p.info["pid"]] = (role, ct.user + ct.system)
        snap = (time.monotonic(), times)
        if self.first is None:
            self.first = snap
        self.last = snap

    def cores(self) -> dict:
        """``{"window_s": seconds sampled, "roles": {role: ...}}``, per role: ``cores`` (CPU seconds per
        second over the window, all its processes), ``max_process_cores`` (the busiest one) and
        ``processes``; {} before two samples."""
        if self.first is None or self.last is None or self.last[0] <= self.first[0]:
            return {}
        dt = self.last[0] - self.first[0]
        out: dict[str, dict] = {}
        for pid, (role, t_end) in self.last[1].items():
            t_start = self.first[1].get(pid, (role, 0.0))[1]  # a process started in the window counts from 0
            used = max(t_end - t_start, 0.0) / dt
            r = out.setdefault(role, {"cores": 0.0, "max_process_cores": 0.0, "processes": 0})
            r["cores"] += used
            r["max_process_cores"] = max(r["max_process_cores"], used)
            r["processes"] += 1
        for r in out.values():
            r["cores"] = round(r["cores"], 3)
            r["max_process_cores"] = round(r["max_process_cores"], 3)
        return {"window_s": round(dt, 1), "roles": out}
