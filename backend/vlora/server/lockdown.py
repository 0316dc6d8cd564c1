"""Tritonserver's lockdown (issue 37): what keeps Triton's admin APIs, its command line and its shared memory
away from clients and other local users.

tritonserver is started with Triton's shared-memory, logging, trace and model-repository APIs restricted on
HTTP and gRPC (restricted_api_flags). They answer only requests whose header ``vlora-admin-key`` (gRPC:
``triton-grpc-protocol-vlora-admin-key``) holds ``triton_admin_key(token)`` (a SHA-256 of the admin token, so
that the token itself never is on a command line); without an admin token they expect a value that no HTTP
header or gRPC metadata can carry (unsendable_value: it holds a line feed), so they are off. Triton reads the
value only from its command line, which other local users can read through /proc/PID/cmdline: once
tritonserver has parsed it (its first log line), the launcher overwrites the value there with line feeds
(hide_argument_value). The server runs with umask 077 (SERVER_UMASK) and, set up in its process before exec
(_server_child_setup), a seccomp filter that keeps boost.interprocess from fchmod-ing its regions back to 0644:
its shared-memory regions (which hold requests' prompts and images) are 0600; its log and a workspace folder
it creates are its user's only. The launcher (launcher.py) checks all of it once the server is ready.
"""
from __future__ import annotations

import hashlib
import secrets
import signal
from pathlib import Path


# Triton's APIs that a client could misuse (register the backend's own shared memory and crash the server,
# switch the error log off, trace requests, unload the model): restricted to holders of the admin key.
RESTRICTED_APIS = ("shared-memory", "logging", "trace", "model-repository")
ADMIN_KEY_HEADER = "vlora-admin-key"  # the HTTP header that carries the key
GRPC_ADMIN_KEY_HEADER = "triton-grpc-protocol-" + ADMIN_KEY_HEADER  # the gRPC metadata key (Triton adds the prefix)
ADMIN_KEY_CONTEXT = "vlora-triton-admin-key:"  # what the token is hashed with (see triton_admin_key)
SERVER_UMASK = 0o077  # tritonserver's files and shared-memory regions: its own user's only
ARGV_HIDE_WAIT_S = 30.0  # how long to wait for tritonserver's first log line before hiding the key anyway


def triton_admin_key(token: str) -> str:
    """The value of the ``vlora-admin-key`` header that opens Triton's restricted APIs, for the admin token
    ``token`` (the token file's text without surrounding whitespace): the SHA-256 of
    ``vlora-triton-admin-key:<token>`` in hex. In a shell:
    ``printf 'vlora-triton-admin-key:%s' "$(cat admin.token)" | sha256sum | cut -d' ' -f1``."""
    return hashlib.sha256((ADMIN_KEY_CONTEXT + token).encode("utf-8")).hexdigest()


def restricted_api_flags(value: str, key: str = ADMIN_KEY_HEADER) -> list[str]:
    """tritonserver's flags that restrict RESTRICTED_APIS on HTTP and gRPC to requests with ``key: value``."""
    apis = ",".join(RESTRICTED_APIS)
    return [f"--http-restricted-api={apis}:{key}={value}", f"--grpc-restricted-protocol={apis}:{key}={value}"]


def unsendable_value() -> str:
    """A restricted-API value that no client can send: random, and holding a line feed, which neither an
    HTTP header nor gRPC metadata can carry. Restricting with it turns the APIs off."""
    return "\n" + secrets.token_hex(32)


def hide_argument_value(pid: int, value: str) -> int:
    """Overwrite each copy of ``value`` in the argument strings of process ``pid`` (what /proc/PID/cmdline and
    ps show) with line feeds, through /proc/PID/mem (our own child: same user). Returns how many copies were
    overwritten; raises OSError when the kernel refuses (e.g. a ptrace policy that forbids it)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
    arg_start, arg_end = int(fields[45]), int(fields[46])  # fields 48 and 49 of proc(5), counted from "state" (3)
    needle = value.encode("utf-8")
    count = 0
    with open(f"/proc/{pid}/mem", "r+b", buffering=0) as mem:
        mem.seek(arg_start)
        args = mem.read(arg_end - arg_start)
        at = args.find(needle)
        while at >= 0 and needle:
            mem.seek(arg_start + at)
            mem.write(b"\n" * len(needle))
            count += 1
            at = args.find(needle, at + len(needle))
    return count


# A seccomp filter for tritonserver and its stubs: fchmod(fd, 0644) returns success without doing anything.
# The Python backend creates its shared-memory regions with boost.interprocess, whose open_or_create calls
# shm_open(name, O_CREAT, 0644) and then fchmod(fd, 0644) "to ignore the umask": under the filter the
# region keeps the mode shm_open gave it under our umask 077, 0600. Only that exact call is affected.
_SECCOMP_FCHMOD = {"x86_64": (0xC000003E, 91), "aarch64": (0xC00000B7, 52)}  # (AUDIT_ARCH_*, __NR_fchmod)


def _ignore_fchmod_0644() -> bool:
    """In the child: install the seccomp filter above (Linux, x86_64 or aarch64). False where it cannot."""
    import ctypes
    import platform

    arch = _SECCOMP_FCHMOD.get(platform.machine())
    if arch is None:
        return False

    class SockFilter(ctypes.Structure):
        _fields_ = [("code", ctypes.c_ushort), ("jt", ctypes.c_ubyte), ("jf", ctypes.c_ubyte), ("k", ctypes.c_uint)]

    class SockFprog(ctypes.Structure):
        _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.POINTER(SockFilter))]

    ld_abs, jeq, ret = 0x20, 0x15, 0x06  # BPF_LD|BPF_W|BPF_ABS, BPF_JMP|BPF_JEQ|BPF_K, BPF_RET|BPF_K
    allow, errno_0 = 0x7FFF0000, 0x00050000  # SECCOMP_RET_ALLOW, SECCOMP_RET_ERRNO with errno 0: "succeeded"
    program = [
        (ld_abs, 0, 0, 4), (jeq, 0, 5, arch[0]),  # seccomp_data.arch
        (ld_abs, 0, 0, 0), (jeq, 0, 3, arch[1]),  # seccomp_data.nr == fchmod
        (ld_abs, 0, 0, 24), (jeq, 0, 1, 0o644),  # low 32 bits of args[1] (little endian): the mode
        (ret, 0, 0, errno_0), (ret, 0, 0, allow),
    ]
    filters = (SockFilter * len(program))(*[SockFilter(*f) for f in program])
    prog = SockFprog(len(program), ctypes.cast(filters, ctypes.POINTER(SockFilter)))
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
    except OSError:
        return False
    if libc.prctl(38, 1, 0, 0, 0) != 0:  # PR_SET_NO_NEW_PRIVS (required for an unprivileged filter)
        return False
    return libc.prctl(22, 2, ctypes.byref(prog), 0, 0) == 0  # PR_SET_SECCOMP, SECCOMP_MODE_FILTER


def _server_child_setup() -> None:
    """In tritonserver's process, before exec: die with the launcher; regions private (see above)."""
    _die_with_parent()
    _ignore_fchmod_0644()  # where it cannot be installed, _check_regions_private makes them 0600 after start


def _die_with_parent() -> None:
    """In the child: get SIGTERM when the launcher dies, so no server outlives it (Linux only)."""
    try:
        import ctypes

        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except OSError:
        pass
