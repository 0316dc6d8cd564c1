"""The launcher's pure parts: configuration flags, the rendered config.pbtxt, finding tritonserver."""
from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path

import pytest
import yaml

from vlora.config import ConfigError, EngineConfig
from vlora.server import launcher, lockdown
from vlora.server.repository import (
    flat_overrides,
    instance_group_for,
    prepare_repository,
    render_config,
    source_repository,
)

TEMPLATE = (source_repository() / "vlora" / "config.pbtxt").read_text()


def parse(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    launcher.add_arguments(p)
    return p.parse_args(argv)


def test_flags_become_engine_settings(tmp_path):
    model = tmp_path / "m"
    model.mkdir()
    opts = launcher.options_from_args(parse([
        "--model", str(model), "--adapters", str(tmp_path), "--device", "cpu", "--dtype", "float32",
        "--max-batch-size", "4", "--set", "scheduler.max_waiting=3", "--set", "cache.num_blocks=128",
    ]))
    e = opts.engine
    assert e.model.path == str(model.resolve()) and e.lora.adapter_root == str(tmp_path.resolve())
    assert (e.model.device, e.model.dtype) == ("cpu", "float32")
    assert (e.scheduler.max_batch_size, e.scheduler.max_waiting, e.cache.num_blocks) == (4, 3, 128)
    assert (opts.http_port, opts.grpc_port, opts.metrics_port) == (8000, 8001, 8002)


def test_config_file_then_flags(tmp_path):
    cfg = tmp_path / "serve.yaml"
    cfg.write_text("scheduler:\n  max_batch_size: 7\n  max_waiting: 9\n")
    opts = launcher.options_from_args(parse(["--config", str(cfg), "--max-batch-size", "2"]))
    assert (opts.engine.scheduler.max_batch_size, opts.engine.scheduler.max_waiting) == (2, 9)


def test_default_serve_config_is_the_defaults():
    path = Path(__file__).resolve().parents[2] / "configs" / "serve" / "default.yaml"
    assert EngineConfig.from_yaml(path) == EngineConfig()


def test_default_serve_config_names_every_setting():
    """The README says default.yaml lists every engine setting with its default: a new field must appear there."""
    path = Path(__file__).resolve().parents[2] / "configs" / "serve" / "default.yaml"
    data = yaml.safe_load(path.read_text())
    defaults = EngineConfig()
    assert set(data) == {f.name for f in dataclasses.fields(defaults)}
    for section in dataclasses.fields(defaults):
        names = {f.name for f in dataclasses.fields(getattr(defaults, section.name))}
        assert set(data[section.name] or {}) == names, f"configs/serve/default.yaml, section {section.name}"


@pytest.mark.parametrize("argv,words", [
    (["--set", "scheduler.nope=1"], "scheduler.nope"),
    (["--set", "no-equals-sign"], "KEY=VALUE"),
    (["--max-batch-size", "0"], "max_batch_size"),
    (["--device", "tpu"], "model.device"),
    (["--http-port", "9000", "--grpc-port", "9000"], "must differ"),
    (["--model", "/no/such/folder"], "--model /no/such/folder: not a folder"),
])
def test_bad_settings_fail_before_anything_starts(argv, words):
    with pytest.raises(ConfigError, match=words):
        launcher.options_from_args(parse(argv))


def test_overrides_round_trip_through_pbtxt_parameters():
    config = EngineConfig().with_overrides({
        "model.path": "/models/2024",  # a name YAML would read as a number must stay a string
        "model.device": "cpu",
        "lora.target_modules": ["q_proj", "v_proj"],
        "scheduler.admission_timeout_s": 2.5,
        "limits.max_images": 3,
    })
    flat = flat_overrides(config)
    assert set(flat) == {"model.path", "model.device", "lora.target_modules", "scheduler.admission_timeout_s", "limits.max_images"}
    assert EngineConfig().with_overrides(flat) == config
    text = render_config(TEMPLATE, flat, instance_group=instance_group_for("cpu"))
    assert 'parameters { key: "model.path" value: { string_value: "\\"/models/2024\\"" } }' in text
    assert "kind: KIND_CPU" in text
    assert text.count("instance_group") == 1


def test_committed_config_runs_with_defaults():
    """The committed file must work unchanged (e.g. in NVIDIA's container): no parameters, decoupled, and no
    dynamic batcher (Triton 2.51's held arrivals for its 500 ms wake-up)."""
    assert "parameters {" not in TEMPLATE.replace("#   parameters {", "")
    assert "decoupled: true" in TEMPLATE and "\ndynamic_batching" not in TEMPLATE
    for name in ("text_input", "image", "stream", "sampling_parameters", "text_output", "finish_reason",
                 "num_input_tokens", "num_output_tokens"):
        assert f'name: "{name}"' in TEMPLATE
    assert render_config(TEMPLATE, {}) == TEMPLATE


def test_instance_groups():
    assert instance_group_for("auto") is None
    assert "KIND_GPU" in instance_group_for("cuda") and "gpus" not in instance_group_for("cuda")
    assert "gpus: [ 2 ]" in instance_group_for("cuda:2")


def test_prepare_repository_copies_the_model(tmp_path):
    repo = prepare_repository(source_repository(), tmp_path / "repo", "backend: \"python\"\n")
    assert (repo / "vlora" / "1" / "model.py").read_text() == (source_repository() / "vlora" / "1" / "model.py").read_text()
    assert (repo / "vlora" / "config.pbtxt").read_text() == 'backend: "python"\n'


def test_tritonserver_and_stub_are_found(tmp_path):
    pytest.importorskip("pytriton", reason="nvidia-pytriton (the serve extra) is not installed")
    from vlora.server.triton_dist import TritonDistribution

    dist = TritonDistribution.locate()
    assert dist.binary.is_file() and dist.stub.parent.name == f"{sys.version_info.major}.{sys.version_info.minor}"
    binary, backends = dist.install(tmp_path / "ts")
    assert binary.is_file() and (backends / "python" / "triton_python_backend_stub").is_file()
    env = dist.environment({"PATH": "/usr/bin"})
    assert env["PATH"].startswith(str(Path(sys.executable).parent))
    assert str(dist.libs) in env["LD_LIBRARY_PATH"]


def test_cli_help_lists_the_subcommands(capsys):
    from vlora.cli import main

    with pytest.raises(SystemExit) as exc:
        main(["--help"])
    assert exc.value.code == 0
    out = capsys.readouterr().out
    assert "serve" in out and "doctor" in out


def test_doctor_reports(capsys):
    from vlora.cli import main

    main(["doctor"])
    out = capsys.readouterr().out
    assert "python" in out and "tritonserver" in out and "atmm" in out


def test_listens_on_loopback_unless_told_and_the_banner_says_where(tmp_path):
    opts = launcher.options_from_args(parse([]))
    assert opts.host == "127.0.0.1"
    banner = launcher.TritonServer(opts).banner()
    assert "listening on 127.0.0.1 (this machine only" in banner and "0.0.0.0 (all" not in banner
    assert "http://127.0.0.1:8000/v2/models/vlora/generate" in banner
    opened = launcher.TritonServer(launcher.options_from_args(parse(["--host", "0.0.0.0"]))).banner()
    assert "listening on 0.0.0.0 (all interfaces" in opened
    assert "http://127.0.0.1:8000" in opened  # where a client on this machine sends requests


def test_banner_names_the_adapter_root(tmp_path):
    (tmp_path / "a1").mkdir()
    (tmp_path / "a1" / "adapter_config.json").write_text("{}")
    banner = launcher.TritonServer(launcher.options_from_args(parse(["--adapters", str(tmp_path)]))).banner()
    assert f"  adapter root: {tmp_path.resolve()} (one PEFT folder per adapter" in banner
    assert "  adapters: a1\n" in banner
    default = launcher.TritonServer(launcher.options_from_args(parse(["--set", f"model.cache_dir={tmp_path}"])))
    assert f"  adapter root: {tmp_path / 'demo-adapters'} (the demo adapters" in default.banner()  # not yet generated
    model = tmp_path / "m"
    model.mkdir()
    assert "adapter root: none (--adapters DIR" in launcher.TritonServer(
        launcher.options_from_args(parse(["--model", str(model)]))).banner()


def test_admin_token_file_enables_load_and_unload_without_showing_the_token(tmp_path):
    token = "tok-" + "x" * 28
    path = tmp_path / "admin.token"
    path.write_text(token + "\n")
    opts = launcher.options_from_args(parse(["--admin-token-file", str(path)]))
    assert opts.engine.lora.admin_token_file == str(path.resolve())
    params = flat_overrides(opts.engine)
    assert params["lora.admin_token_file"] == f'"{path.resolve()}"' and token not in repr(params)
    banner = launcher.TritonServer(opts).banner()
    assert f"load/unload need the token in {path.resolve()}" in banner and token not in banner
    assert "load/unload are off (enable them with --admin-token-file FILE)" in launcher.TritonServer(
        launcher.options_from_args(parse([]))).banner()
    (tmp_path / "short").write_text("abc\n")
    for bad, words in ((tmp_path / "short", "at least 16 characters"), (tmp_path / "missing", "cannot be read")):
        with pytest.raises(ConfigError, match=words) as err:
            launcher.options_from_args(parse(["--admin-token-file", str(bad)]))
        assert "abc" not in str(err.value)


def test_tritons_admin_apis_are_restricted_by_a_key_derived_from_the_token(tmp_path):
    """Issue 37, hole 1: shared-memory, logging, trace and model-repository are restricted on HTTP and gRPC,
    by the token's derived key (never the token itself); without a token, by a value no client can send."""
    token = "tok-" + "y" * 28
    path = tmp_path / "admin.token"
    path.write_text(f"  {token}\n")
    paths = (Path("bin/tritonserver"), Path("backends"), Path("repo"))
    cmd = launcher.TritonServer(launcher.options_from_args(parse(["--admin-token-file", str(path)]))).command(*paths)
    key = lockdown.triton_admin_key(token)
    assert key == lockdown.hashlib.sha256(f"vlora-triton-admin-key:{token}".encode()).hexdigest()
    apis = "shared-memory,logging,trace,model-repository"
    assert f"--http-restricted-api={apis}:vlora-admin-key={key}" in cmd
    assert f"--grpc-restricted-protocol={apis}:vlora-admin-key={key}" in cmd
    assert token not in "\0".join(cmd)
    off = [launcher.TritonServer(launcher.options_from_args(parse([]))).command(*paths) for _ in range(2)]
    values = [next(a for a in c if a.startswith("--http-restricted-api=")).split("vlora-admin-key=", 1)[1] for c in off]
    assert all("\n" in v and len(v) > 32 for v in values) and values[0] != values[1]
    for c, v in zip(off, values):
        assert f"--grpc-restricted-protocol={apis}:vlora-admin-key={v}" in c


def test_hide_argument_value_overwrites_it_on_the_command_line():
    """The key is overwritten in /proc/PID/cmdline of a running process, which keeps running."""
    import subprocess
    import time

    secret = "s3cret-" + lockdown.secrets.token_hex(8)
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)", f"--key=a:{secret}", "tail"])
    try:
        time.sleep(0.2)
        assert secret in Path(f"/proc/{proc.pid}/cmdline").read_text()
        assert lockdown.hide_argument_value(proc.pid, secret) == 1
        cmdline = Path(f"/proc/{proc.pid}/cmdline").read_text().split("\0")
        assert secret not in "\0".join(cmdline) and cmdline[3] == "--key=a:" + "\n" * len(secret) and cmdline[4] == "tail"
        assert proc.poll() is None
    finally:
        proc.kill()
        proc.wait()


def test_tritonserver_child_keeps_its_files_private_despite_boosts_fchmod(tmp_path):
    """Issue 37, hole 2: boost.interprocess creates the Python backend's shared memory with shm_open(0644) and
    then fchmod(fd, 0644), which ignores the umask. In tritonserver's process (umask 077 and the launcher's
    seccomp filter) that fchmod does nothing, so the region stays 0600; other modes still apply."""
    import platform
    import subprocess

    if platform.machine() not in lockdown._SECCOMP_FCHMOD:
        pytest.skip(f"no seccomp filter for {platform.machine()}")
    probe = ("import os, sys; fd = os.open(sys.argv[1], os.O_CREAT | os.O_RDWR, 0o644); os.fchmod(fd, 0o644); "
             "print(oct(os.stat(sys.argv[1]).st_mode & 0o777)); os.fchmod(fd, 0o640); print(oct(os.stat(sys.argv[1]).st_mode & 0o777))")
    plain = subprocess.run([sys.executable, "-c", probe, str(tmp_path / "a")], umask=lockdown.SERVER_UMASK,
                           capture_output=True, text=True, check=True).stdout.split()
    assert plain == ["0o644", "0o640"]  # what boost does to a region without the filter
    child = subprocess.run([sys.executable, "-c", probe, str(tmp_path / "b")], umask=lockdown.SERVER_UMASK,
                           preexec_fn=lockdown._server_child_setup, capture_output=True, text=True, check=True).stdout.split()
    assert child == ["0o600", "0o640"]


def test_a_small_dev_shm_is_named(monkeypatch, tmp_path):
    """Triton's Python backend passes requests, images and responses through /dev/shm: below 1 GiB free (a
    container's 64 MB default) vlora serve warns at start and vlora doctor flags it; unreadable, it says so."""
    import os
    from types import SimpleNamespace

    from vlora.server import launcher

    monkeypatch.setattr(os, "statvfs", lambda p: SimpleNamespace(f_bavail=16384, f_frsize=4096))  # 64 MiB
    enough, low = launcher.shm_room(tmp_path)
    assert not enough and "64 MiB free" in low and "--shm-size" in low
    monkeypatch.setattr(os, "statvfs", lambda p: SimpleNamespace(f_bavail=1 << 20, f_frsize=4096))  # 4 GiB
    assert launcher.shm_room(tmp_path) == (True, f"{tmp_path}: 4.0 GiB free")

    def unreadable(p):
        raise FileNotFoundError(2, "No such file or directory")

    monkeypatch.setattr(os, "statvfs", unreadable)
    enough, finding = launcher.shm_room(tmp_path)
    assert not enough and "cannot be read" in finding
