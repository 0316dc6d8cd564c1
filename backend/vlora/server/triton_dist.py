"""Find the ``tritonserver`` that ships in the ``nvidia-pytriton`` wheel and make it runnable here.

The wheel carries the real Triton Inference Server (binary, Python backend, one backend stub per
Python minor version) and its shared libraries in ``site-packages/nvidia_pytriton.libs``. The stub is
linked against ``libpython3.X.so``: it must match the Python that runs us, and it must see this
environment's packages, which it does when this interpreter's ``bin`` comes first on ``PATH``.
"""
from __future__ import annotations

import ctypes.util
import filecmp
import importlib.util
import os
import shutil
import sys
import sysconfig
from dataclasses import dataclass
from pathlib import Path


class TritonNotFound(RuntimeError):
    """The Triton distribution cannot be used from this Python; the message says how to fix it."""


@dataclass(frozen=True)
class TritonDistribution:
    """Paths inside an installed nvidia-pytriton wheel."""

    root: Path  # site-packages/pytriton/tritonserver
    binary: Path  # root/bin/tritonserver
    backends: Path  # root/backends (python backend without a stub)
    stub: Path  # root/python_backend_stubs/<X.Y>/triton_python_backend_stub
    libs: Path  # site-packages/nvidia_pytriton.libs
    python_libdir: Path  # where libpython3.X.so of this interpreter lives

    @classmethod
    def locate(cls) -> "TritonDistribution":
        spec = importlib.util.find_spec("pytriton")
        if spec is None or not spec.submodule_search_locations:
            raise TritonNotFound(
                "nvidia-pytriton is not installed in this Python environment "
                f"({sys.executable}); it ships the tritonserver binary. Install it with "
                "`pip install -e \".[serve]\"` (or `pip install nvidia-pytriton`)."
            )
        pkg = Path(list(spec.submodule_search_locations)[0])
        root = pkg / "tritonserver"
        binary = root / "bin" / "tritonserver"
        if not binary.is_file():
            raise TritonNotFound(f"nvidia-pytriton at {pkg} has no tritonserver binary at {binary}")
        version = f"{sys.version_info.major}.{sys.version_info.minor}"
        stubs = root / "python_backend_stubs"
        stub = stubs / version / "triton_python_backend_stub"
        if not stub.is_file():
            have = sorted(p.name for p in stubs.iterdir()) if stubs.is_dir() else []
            raise TritonNotFound(
                f"nvidia-pytriton at {pkg} has no Python backend stub for Python {version} "
                f"(it has stubs for {have}); run vlora with one of those Python versions."
            )
        libs = pkg.parent / "nvidia_pytriton.libs"
        if not libs.is_dir():
            # An editable pytriton install keeps them next to the binary instead.
            libs = root / "external_libs"
        if not libs.is_dir():
            raise TritonNotFound(f"nvidia-pytriton at {pkg}: shared libraries not found (nvidia_pytriton.libs)")
        libdir = Path(sysconfig.get_config_var("LIBDIR") or "")
        if not _find_libpython(version, libdir):
            raise TritonNotFound(
                f"no shared libpython{version}.so.1.0 for this Python ({sys.executable}): looked in {libdir}, "
                "LD_LIBRARY_PATH and the system's library cache. The Triton Python backend stub links it; "
                f"install it (Debian/Ubuntu: apt-get install libpython{version}) or use a Python built with "
                "--enable-shared."
            )
        return cls(root=root, binary=binary, backends=root / "backends", stub=stub, libs=libs, python_libdir=libdir)

    def install(self, dest: Path) -> tuple[Path, Path]:
        """Copy the binary and backends into ``dest`` with this Python's stub in place.

        Triton looks for the stub inside the backend directory, and the wheel's own directory must
        stay untouched (several Pythons may share it), hence the copy. Returns (binary, backend_dir).
        """
        dest.mkdir(parents=True, exist_ok=True)
        bin_dir = dest / "bin"
        backends = dest / "backends"
        _sync_tree(self.binary.parent, bin_dir)
        _sync_tree(self.backends, backends, ignore=("__pycache__",))
        stub_dst = backends / "python" / "triton_python_backend_stub"
        if not stub_dst.exists() or not filecmp.cmp(self.stub, stub_dst, shallow=False):
            shutil.copy2(self.stub, stub_dst)
        return bin_dir / "tritonserver", backends

    def environment(self, base: dict[str, str]) -> dict[str, str]:
        """The process environment for tritonserver: library path and this interpreter first on PATH."""
        env = dict(base)
        ld = [str(self.python_libdir), str(self.libs)]
        if env.get("LD_LIBRARY_PATH"):
            ld.append(env["LD_LIBRARY_PATH"])
        env["LD_LIBRARY_PATH"] = ":".join(ld)
        env["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), env.get("PATH", "")])
        return env


def _sync_tree(src: Path, dst: Path, ignore: tuple[str, ...] = ()) -> None:
    """Copy ``src`` to ``dst``, skipping files that already match in size and mtime."""
    for path in src.rglob("*"):
        rel = path.relative_to(src)
        if any(part in ignore for part in rel.parts):
            continue
        target = dst / rel
        if path.is_dir():
            target.mkdir(parents=True, exist_ok=True)
            continue
        target.parent.mkdir(parents=True, exist_ok=True)
        st = path.stat()
        if target.exists():
            tt = target.stat()
            if tt.st_size == st.st_size and int(tt.st_mtime) == int(st.st_mtime):
                continue
        shutil.copy2(path, target)


def _find_libpython(version: str, libdir: Path) -> bool:
    """Whether the dynamic loader can find libpython<version>.so.1.0 for the stub."""
    name = f"libpython{version}.so.1.0"
    dirs = [libdir] + [Path(d) for d in os.environ.get("LD_LIBRARY_PATH", "").split(":") if d]
    if any((d / name).exists() for d in dirs):
        return True
    return ctypes.util.find_library(f"python{version}") is not None
