"""The server's processes as Linux shows them in /proc: a process's children (to find tritonserver's Python
backend stubs) and whether a process is still alive (a zombie is not)."""
from __future__ import annotations

from pathlib import Path


def child_processes(parent: int) -> list[tuple[int, str, str]]:
    """(pid, name, state) of ``parent``'s child processes, read from /proc (state "Z": a zombie; the name is
    the kernel's, cut to 15 characters)."""
    out = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        comm, _, rest = stat.rpartition(")")
        fields = rest.split()
        if len(fields) > 1 and int(fields[1]) == parent:
            out.append((int(entry.name), comm.partition("(")[2], fields[0]))
    return out


def _alive(pid: int) -> bool:
    """False once ``pid`` has exited (a zombie that its parent has not reaped counts as exited)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rpartition(")")[2].split()[0] != "Z"
