"""Memory of the server under test, for long runs (``benchmarks/soak.py``): tritonserver (the process whose command
line names ``--http-port=PORT``) and its Python backend stubs, their RSS from /proc, on CUDA their GPU memory from
nvidia-smi, and the server's running/waiting gauges, sampled on a thread; :func:`flatness` compares a figure after
the warm-up with the end of the run.
"""
from __future__ import annotations

import re
import shutil
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Optional, TextIO

from vlora_load.scrape import gauges


@dataclass
class ServerProcesses:
    """tritonserver (the process whose command line names ``--http-port=PORT``) and its stub children."""

    http_port: int

    @classmethod
    def of(cls, http_url: str, out: TextIO = sys.stdout) -> Optional["ServerProcesses"]:
        """The processes of the server at ``http_url`` (host:port) when it runs on this machine (a loopback address
        and a tritonserver found with that port); None otherwise (saying so when it is not found)."""
        procs = cls(int(http_url.rpartition(":")[2])) if http_url.startswith(("127.", "localhost")) else None
        if procs is not None and procs.server_pid() is None:
            out.write(f"no tritonserver with --http-port={procs.http_port} on this machine: RSS is not measured\n")
            out.flush()
            return None
        return procs

    def server_pid(self) -> Optional[int]:
        for entry in Path("/proc").iterdir():
            if not entry.name.isdigit():
                continue
            try:
                args = (entry / "cmdline").read_bytes().split(b"\0")
            except OSError:
                continue
            if args and args[0].endswith(b"tritonserver") and f"--http-port={self.http_port}".encode() in args:
                return int(entry.name)
        return None

    @staticmethod
    def stub_pids(server_pid: int) -> list[int]:
        from vlora.server.launcher import STUB_NAME
        from vlora.server.processes import child_processes

        return sorted(pid for pid, name, _ in child_processes(server_pid) if name and STUB_NAME.startswith(name))

    @staticmethod
    def rss_mb(pid: int) -> Optional[dict]:
        """VmRSS and its anonymous / shared-memory parts, MB."""
        try:
            text = Path(f"/proc/{pid}/status").read_text()
        except OSError:
            return None
        kb = {k: int(v.split()[0]) for k, v in re.findall(r"^(VmRSS|RssAnon|RssShmem|RssFile):\s+(.*)$", text, re.M)}
        return {"rss": kb.get("VmRSS", 0) / 1024, "anon": kb.get("RssAnon", 0) / 1024, "shmem": kb.get("RssShmem", 0) / 1024}

    def sample(self) -> dict:
        pid = self.server_pid()
        if pid is None:
            return {"server_pid": None}
        server = self.rss_mb(pid)
        stubs = {p: m for p in self.stub_pids(pid) if (m := self.rss_mb(p)) is not None}

        def total(key: str) -> Optional[float]:
            return round(sum(m[key] for m in stubs.values()), 1) if stubs else None

        out = {"server_pid": pid, "stub_pids": sorted(stubs), "server_rss_mb": round(server["rss"], 1) if server else None,
               "stub_rss_mb": total("rss"), "stub_anon_mb": total("anon"), "stub_shmem_mb": total("shmem")}
        out.update(gpu_memory(sorted(stubs) + [pid]))
        return out


def gpu_memory(pids: list[int]) -> dict:
    """On a CUDA machine: the GPU memory the server's processes hold (nvidia-smi, per pid) and the GPUs'
    used total; {} without nvidia-smi. (A client-side torch.cuda query would measure the wrong process.)"""
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return {}
    try:
        apps, gpus = (subprocess.run([smi, query, "--format=csv,noheader,nounits"], capture_output=True, text=True,
                                     timeout=15).stdout
                      for query in ("--query-compute-apps=pid,used_memory", "--query-gpu=index,memory.used"))
    except (OSError, subprocess.TimeoutExpired):
        return {}
    per_pid = {}
    for line in apps.splitlines():
        parts = [p.strip() for p in line.split(",")]
        if len(parts) == 2 and parts[0].isdigit() and parts[1].isdigit():
            per_pid[int(parts[0])] = float(parts[1])
    used = [float(p.split(",")[1]) for p in gpus.splitlines() if "," in p and p.split(",")[1].strip().isdigit()]
    ours = [per_pid[p] for p in pids if p in per_pid]
    # In a container the pids nvidia-smi shows may be the host's: then only the GPUs' total is known.
    return {"gpu_server_mb": sum(ours) if ours else None, "gpu_used_total_mb": sum(used) if used else None}


def flatness(samples: list[dict], duration_s: float, warmup_fraction: float, key: str) -> Optional[dict]:
    """``key`` (an RSS in MB) around ``warmup_fraction`` of the run (median of the samples within 5% of the
    run of that point) against the end (median of the samples of the run's last 5%)."""
    timed = [(s["t_s"], s[key]) for s in samples if s.get(key) is not None and s["t_s"] <= duration_s + 1]
    if len(timed) < 2:
        return None
    at = warmup_fraction * duration_s
    warm = [v for t, v in timed if abs(t - at) <= 0.05 * duration_s] or [min(timed, key=lambda tv: abs(tv[0] - at))[1]]
    end = [v for t, v in timed if t >= 0.95 * duration_s] or [timed[-1][1]]
    w, e = sorted(warm)[len(warm) // 2], sorted(end)[len(end) // 2]
    peak = max(v for t, v in timed if t >= at)
    return {"warmup_mb": round(w, 1), "end_mb": round(e, 1), "growth_mb": round(e - w, 1),
            "growth_pct": round(100.0 * (e - w) / w, 2) if w else None, "peak_after_warmup_mb": round(peak, 1)}


class MemorySampler:
    """Samples the server's memory (``procs``; None: gauges only) and gauges every ``every_s`` on its own
    thread until stopped; ``t_s`` of a sample counts from ``t0`` (monotonic)."""

    def __init__(self, procs: Optional[ServerProcesses], metrics_url: str, every_s: float, t0: float) -> None:
        self.procs, self.metrics_url, self.every_s, self.t0 = procs, metrics_url, every_s, t0
        self.samples: list[dict] = []
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="vlora-memory-sampler", daemon=True)

    def start(self) -> "MemorySampler":
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=30)

    def sample_now(self) -> dict:
        s = {"t_s": round(time.monotonic() - self.t0, 1)}
        if self.procs is not None:
            s.update(self.procs.sample())
        s.update(gauges(self.metrics_url))
        with self._lock:
            self.samples.append(s)
        return s

    def latest(self) -> dict:
        with self._lock:
            return dict(self.samples[-1]) if self.samples else {}

    def all(self) -> list[dict]:
        with self._lock:
            return list(self.samples)

    def _loop(self) -> None:
        while not self._stop.wait(self.every_s):
            self.sample_now()


def memory_line(s: dict) -> str:
    """One sample of :class:`MemorySampler` as a line."""
    if not s.get("server_pid"):
        return "  memory: tritonserver not found on this machine (RSS not measured)"
    parts = [f"tritonserver RSS {s.get('server_rss_mb')} MB",
             f"stub RSS {s.get('stub_rss_mb')} MB (anon {s.get('stub_anon_mb')}, shm {s.get('stub_shmem_mb')})"]
    if s.get("gpu_server_mb") is not None or s.get("gpu_used_total_mb") is not None:
        parts.append(f"GPU: server {s.get('gpu_server_mb')} MB, all GPUs used {s.get('gpu_used_total_mb')} MB")
    parts.append(f"running {s.get('vlora_running_requests', '-'):g} waiting {s.get('vlora_waiting_requests', '-'):g}"
                 if "vlora_running_requests" in s else "gauges -")
    return "  memory: " + ", ".join(parts)
