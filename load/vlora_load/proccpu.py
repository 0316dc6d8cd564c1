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
    """Samples the CPU time of every process whose command line names a role (see ``ROLES``).

    Each process counts from the first to the last sample that saw it under its role: a process that
    exits (or turns zombie, its command line gone) before the last sample keeps what it used."""

    def __init__(self) -> None:
        try:
            import psutil
        except ImportError:  # pragma: no cover - psutil comes with locust
            psutil = None
        self._psutil = psutil
        self.t_first: Optional[float] = None
        self.t_last: Optional[float] = None
        self.seen: dict[int, list] = {}  # pid -> [role, CPU seconds at its first sample, at its last]

    def sample(self) -> None:
        if self._psutil is None:
            return
        now = time.monotonic()
        for p in self._psutil.process_iter(["pid", "cmdline", "cpu_times"]):
            try:
                role = role_of(p.info["cmdline"] or [])
                ct = p.info["cpu_times"]
            except (self._psutil.Error, TypeError):
                continue
            if role is None or ct is None:
                continue
            used = ct.user + ct.system
            entry = self.seen.get(p.info["pid"])
            if entry is None or entry[0] != role:
                # first seen after the first sample: it started in the window and counts from 0
                self.seen[p.info["pid"]] = [role, used if self.t_first is None else 0.0, used]
            else:
                entry[2] = used
        if self.t_first is None:
            self.t_first = now
        self.t_last = now

    def cores(self) -> dict:
        """``{"window_s": seconds sampled, "roles": {role: ...}}``, per role: ``cores`` (CPU seconds per
        second over the window, all its processes), ``max_process_cores`` (the busiest one) and
        ``processes``; {} before two samples."""
        if self.t_first is None or self.t_last is None or self.t_last <= self.t_first:
            return {}
        dt = self.t_last - self.t_first
        out: dict[str, dict] = {}
        for role, first, last in self.seen.values():
            used = max(last - first, 0.0) / dt
            r = out.setdefault(role, {"cores": 0.0, "max_process_cores": 0.0, "processes": 0})
            r["cores"] += used
            r["max_process_cores"] = max(r["max_process_cores"], used)
            r["processes"] += 1
        for r in out.values():
            r["cores"] = round(r["cores"], 3)
            r["max_process_cores"] = round(r["max_process_cores"], 3)
        return {"window_s": round(dt, 1), "roles": out}
