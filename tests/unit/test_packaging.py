"""A regular install ships what serving needs: the tiling tables are package data, found without a checkout;
and the tuner sidecar gets its environment through ``env=``, never by changing this process's."""
from __future__ import annotations

import importlib.util
import json
import os
import shutil
import site
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from vlora.atmm import tuner
from vlora.atmm.tiling import default_table_dir, shipped_tables, table_path
from vlora.engine import builder

REPO = Path(__file__).resolve().parents[2]
H100 = "NVIDIA H100 80GB HBM3"
# What a wheel is built from: the project file, its readme, the packages and the data-files source.
BUILD_INPUTS = ("pyproject.toml", "README.md", "backend", "client", "load", "model_repository")


def _run(cmd: list[str], **kwargs) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, capture_output=True, text=True, timeout=120, **kwargs)


def test_the_checkout_serves_the_shipped_tables_and_configs_tiling_names_them():
    assert default_table_dir() == REPO / "backend" / "vlora" / "atmm" / "tables"
    assert "nvidia-h100-80gb-hbm3" in shipped_tables()
    assert table_path(H100).is_file()
    # configs/tiling, the place the docs and the tuner's help name, is the same folder (one copy).
    assert (REPO / "configs" / "tiling").resolve() == default_table_dir().resolve()


def test_child_env_shows_the_child_only_the_engine_gpu_and_leaves_this_process_alone(monkeypatch):
    code = "import os; print(os.environ.get('CUDA_VISIBLE_DEVICES', '<unset>'))"

    def child_sees(env):
        return _run([sys.executable, "-c", code], env=env, check=True).stdout.strip()

    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    assert child_sees(builder.child_env(1)) == "1"
    assert "CUDA_VISIBLE_DEVICES" not in os.environ

    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "2,5")
    monkeypatch.setenv("VLORA_PACKAGING_MARK", "kept")
    env = builder.child_env(1)
    assert child_sees(env) == "5"
    assert env["VLORA_PACKAGING_MARK"] == "kept"  # the rest of the environment is inherited
    assert os.environ["CUDA_VISIBLE_DEVICES"] == "2,5"

    assert builder.child_env(None) is None  # a CPU engine: the child inherits this environment
    assert builder.child_env(2) is None  # device 2 of "2,5" cannot be told: inherit, as before
    assert builder.child_env(0, {"CUDA_VISIBLE_DEVICES": "GPU-a,GPU-b"}) == {"CUDA_VISIBLE_DEVICES": "GPU-a"}


def test_the_sidecar_is_started_with_the_env_it_was_given(monkeypatch, tmp_path):
    started = {}

    class FakePopen:
        pid = 4242

        def __init__(self, cmd, **kwargs):
            started.update(kwargs, cmd=cmd)

    monkeypatch.setattr(tuner.subprocess, "Popen", FakePopen)
    before = dict(os.environ)
    car = tuner.TunerSidecar(kernels=None, out=tmp_path / "t.json", tuner_args=["--widths", "64"],
                             env={"CUDA_VISIBLE_DEVICES": "3", "PATH": os.environ.get("PATH", "")})
    car.start()
    car._close_log()
    assert started["env"]["CUDA_VISIBLE_DEVICES"] == "3"
    assert started["cmd"][1:3] == ["-m", "vlora.atmm.tuner"]
    assert dict(os.environ) == before

    inherit = tuner.TunerSidecar(kernels=None, out=tmp_path / "u.json", tuner_args=[])
    inherit.start()
    inherit._close_log()
    assert started["env"] is None  # no env given: the child inherits this process's


@pytest.mark.skipif(sys.platform != "linux", reason="PR_SET_PDEATHSIG is Linux's")
def test_the_sidecar_ends_with_the_process_that_started_it(tmp_path):
    """A server or test process that exits without stopping its engine must not leave the tuner profiling
    on the GPU: the sidecar is started with _die_with_parent, so it gets SIGKILL when its parent ends."""
    import time

    parent = ("import subprocess, sys\n"
              "from vlora.atmm.tuner import _die_with_parent\n"
              "p = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(120)'], preexec_fn=_die_with_parent)\n"
              "print(p.pid, flush=True)\n")
    out = subprocess.run([sys.executable, "-c", parent], capture_output=True, text=True, timeout=60,
                         env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
    assert out.returncode == 0, out.stderr
    child = int(out.stdout.split()[0])
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        try:
            os.kill(child, 0)
        except ProcessLookupError:
            return
        # an orphan is reparented; once killed it may linger as a zombie of its new parent until reaped
        try:
            with open(f"/proc/{child}/stat") as fh:
                if fh.read().split(") ")[1].startswith("Z"):
                    return
        except FileNotFoundError:
            return
        time.sleep(0.1)
    os.kill(child, 9)
    raise AssertionError("the sidecar outlived the process that started it")


def _site_dirs() -> list[str]:
    """This interpreter's site-packages (torch and the other dependencies live there)."""
    dirs = list(site.getsitepackages())
    if site.ENABLE_USER_SITE:
        dirs.append(site.getusersitepackages())
    return [d for d in dirs if os.path.isdir(d)]


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_a_wheel_installed_into_a_fresh_venv_serves_its_own_tiling_tables(tmp_path):
    """Build a wheel, install it (no deps) into a fresh venv, and ask the installed package and
    ``vlora doctor`` which tables serve: the ones inside the venv, not the checkout's."""
    if importlib.util.find_spec("setuptools") is None:
        pytest.skip("setuptools (the build backend) is not installed here, and --no-build-isolation cannot fetch it")

    src = tmp_path / "src"  # built from a copy: a build in the checkout would leave build/ and egg-info behind
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc", "*.egg-info", "build", "*.so")
    src.mkdir()
    for name in BUILD_INPUTS:
        path = REPO / name
        if path.is_dir():
            shutil.copytree(path, src / name, ignore=ignore)
        else:
            shutil.copy2(path, src / name)
    dist = tmp_path / "dist"
    built = _run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--no-index",
                  "-q", "-w", str(dist), str(src)])
    assert built.returncode == 0, built.stdout + built.stderr
    (wheel,) = dist.glob("vlora-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    for slug in shipped_tables():
        assert f"vlora/atmm/tables/{slug}.json" in names
    # The trained demo adapters, the Triton model's server modules and the load tests with their workloads.
    for name in ("vlora/lora/demo_adapters/demo-shapes/adapter_model.safetensors", "vlora/server/wire.py",
                 "vlora_load/cli.py", "vlora_load/workloads/smoke.yaml"):
        assert name in names, name

    # A bare venv: pip installs into it from outside (--python), before it can see any other vlora.
    venv = tmp_path / "venv"
    made = _run([sys.executable, "-m", "venv", "--without-pip", str(venv)])
    assert made.returncode == 0, made.stderr
    python = venv / "bin" / "python"
    installed = _run([sys.executable, "-m", "pip", "--python", str(python), "install", "--no-deps", "--no-index",
                      "-q", str(wheel)])
    assert installed.returncode == 0, installed.stdout + installed.stderr
    # The dependencies (torch, ...) come from this interpreter's site-packages, appended after the venv's
    # own. A path line in a .pth does not run that folder's .pth files, so an editable install's finder
    # there is never installed and cannot shadow the wheel.
    purelib = Path(_run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"]).stdout.strip())
    (purelib / "_vlora_test_deps.pth").write_text("".join(f"{d}\n" for d in _site_dirs()))

    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env["CUDA_VISIBLE_DEVICES"] = ""  # the CPU answer on any machine
    code = ("import json, vlora, vlora.atmm.tiling as t, vlora_load.workload as w; "
            f"print(json.dumps({{'package': vlora.__file__, 'table': str(t.table_path({H100!r})), "
            "'shipped': t.shipped_tables(), 'smoke': str(w.resolve_workload('smoke'))}))")
    asked = _run([str(python), "-c", code], cwd=tmp_path, env=env)
    assert asked.returncode == 0, asked.stderr
    answer = json.loads(asked.stdout)
    assert Path(answer["package"]).is_relative_to(purelib), answer
    table = Path(answer["table"])
    assert table.is_relative_to(purelib / "vlora" / "atmm" / "tables") and table.is_file(), answer
    assert answer["shipped"] == shipped_tables()
    assert Path(answer["smoke"]).is_relative_to(purelib / "vlora_load" / "workloads"), answer

    doctor = _run([str(venv / "bin" / "vlora"), "doctor"], cwd=tmp_path, env=env)
    # rc 1 only says some row is missing (tritonserver, tritonclient): that is this machine, not the install.
    assert doctor.returncode in (0, 1) and "Traceback" not in doctor.stderr, doctor.stdout + doctor.stderr
    assert f"tiling_table_dir: {purelib / 'vlora' / 'atmm' / 'tables'}" in doctor.stdout, doctor.stdout
    assert "nvidia-h100-80gb-hbm3" in doctor.stdout, doctor.stdout
