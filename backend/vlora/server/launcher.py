"""``vlora serve``: start the real Triton Inference Server on our model repository.

Steps: resolve the engine configuration (defaults, ``--config`` YAML, flags, ``--set``); generate the
tiny default model and its demo adapters when they are used; copy tritonserver with this Python's
backend stub and a model repository whose config carries the settings into a workspace; start the
server, wait until it is ready while reporting progress, print where to send requests (banner.py), and forward
SIGINT/SIGTERM so that the server drains in-flight requests before it exits.

Fail-safe: the model's engine, when it fails, logs ``vlora: ENGINE FAILED: <cause>`` and ends its stub
process (Triton neither restarts a dead Python stub nor reports the model unready). The launcher
watches the stub processes and the log: it prints the cause, stops the server (readiness goes with
it) and exits with ENGINE_FAILED_EXIT, for a supervisor to restart. Stopping is bounded: SIGTERM, then
after the exit timeout SIGKILL to the server's whole process group (its stubs included); the server's
shared-memory regions (named with a prefix unique to this launch) are removed at exit.

The OpenAI-compatible API (issue 39, vlora.server.openai) runs as a process of its own (vlora.server.frontend) on
``--openai-port`` (0: off), started once tritonserver is ready and waited for (its /health) before the banner;
it dies with the launcher, is stopped with the server, and if it exits while serving, the launcher says so
and stops the server (exit code OPENAI_FAILED_EXIT).

Several GPUs (issue 40): with ``--routing auto`` (the default) and a device setting that reaches two or more GPUs,
the workspace repository holds one engine model per GPU and the router model ``vlora`` in front of them
(vlora.server.routing; repository.py writes it); the launcher makes the routing board the engines publish on and
waits for every model to be ready. One GPU, ``--device cuda:N``, the CPU or ``--routing off``: one ``vlora`` model,
one instance per GPU, as before.

Security (issue 37): tritonserver runs locked down, its admin APIs restricted to the admin key, the key
hidden on its command line, its shared-memory regions 0600 (lockdown.py); start checks all of it.
"""
from __future__ import annotations

import argparse
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Optional, TextIO

from vlora.config import ConfigError, EngineConfig, default_cache_dir, read_admin_token
from vlora.server.banner import list_adapter_names, serving_banner  # noqa: F401 (list_adapter_names: load's)
from vlora.server.frontend import FrontendStartError, OpenAIFrontendProcess
from vlora.server.http_probe import http_ok as _http_ok
from vlora.server.http_probe import http_status as _http_status
from vlora.server.lockdown import (
    ADMIN_KEY_HEADER,
    ARGV_HIDE_WAIT_S,
    SERVER_UMASK,
    _server_child_setup,
    hide_argument_value,
    restricted_api_flags,
    triton_admin_key,
    unsendable_value,
)
from vlora.server.options import ServeOptions, add_arguments, options_from_args  # noqa: F401 (add_arguments: `vlora serve`'s)
from vlora.server.ports import ServerUrls
from vlora.server.processes import _alive, child_processes
from vlora.server.repository import (
    MODEL_NAME,
    engine_instance_group,
    flat_overrides,
    instance_group_for,
    prepare_repository,
    prepare_routed_repository,
    render_config,
    routed_engines,
    router_instance_group,
    source_repository,
)
from vlora.server.routing import BOARD_PARAM, ENGINES_PARAM, MARGIN_PARAM, SLOT_PARAM, engine_model_name
from vlora.server.routing.board import create_board
from vlora.server.triton_dist import TritonDistribution, TritonNotFound


ENGINE_FAILED_EXIT = 3  # `vlora serve`'s exit code when the model's engine failed while serving
OPENAI_FAILED_EXIT = 4  # `vlora serve`'s exit code when the OpenAI front end exited while serving
ENGINE_FAILED_MARK = "vlora: ENGINE FAILED"  # the line model.py logs (its ENGINE_FAILED)
STUB_NAME = "triton_python_backend_stub"
SHM_DIR = Path("/dev/shm")
SHM_LOW_BYTES = 1 << 30  # less free in SHM_DIR than this: vlora serve warns at start and vlora doctor flags it
POLL_S = 0.25  # how often serve_forever looks at the server, its stubs and its log
KILL_MARGIN_S = 15.0  # after a SIGTERM, how much longer than --exit-timeout-secs before SIGKILL
DEAD_STUB_GRACE_S = 5.0  # after a stub died, how long the server may take to stop before SIGKILL


class LaunchError(RuntimeError):
    """The server could not be started; the message says why (and shows the log tail)."""


def run(args: argparse.Namespace) -> int:
    """Entry point of ``vlora serve``."""
    out = sys.stdout
    try:
        options = options_from_args(args)
    except ConfigError as e:
        print(f"vlora serve: {e}", file=sys.stderr, flush=True)
        return 2
    server = TritonServer(options, out=out)
    # A signal while the model loads stops the server too (serve_forever installs the draining handlers).
    previous = signal.signal(signal.SIGTERM, _interrupt)
    try:
        server.start()
    except (ConfigError, TritonNotFound, LaunchError, FileNotFoundError) as e:
        print(f"vlora serve: {e}", file=sys.stderr, flush=True)
        return 2
    except KeyboardInterrupt:
        _say(out, "interrupted while starting: stopping tritonserver ...")
        server.stop()
        return 130
    finally:
        signal.signal(signal.SIGTERM, previous)
    return server.serve_forever()


def _interrupt(signum, _frame):
    raise KeyboardInterrupt(signal.Signals(signum).name)


def prepare_default_artifacts(config: EngineConfig, out: TextIO) -> tuple[Optional[str], Optional[str]]:
    """Generate the tiny model and demo adapters now, with progress, when the config uses them.

    The engine generates them on load too, in the same places; doing it here shows what is
    happening before the server starts. Returns (model folder, adapter root) as the engine will see them.
    """
    if config.model.path is not None:
        return config.model.path, config.lora.adapter_root
    try:
        from vlora.lora.demo import ensure_demo_adapters
        from vlora.models.tiny import ensure_tiny_model
    except ImportError:  # the engine reports it when it loads
        return None, config.lora.adapter_root
    cache_dir = Path(config.model.cache_dir) if config.model.cache_dir else default_cache_dir()
    _say(out, f"preparing the embedded tiny model in {cache_dir} (first run only) ...")
    t0 = time.monotonic()
    model_dir = ensure_tiny_model(cache_dir)
    _say(out, f"  tiny model: {model_dir} ({time.monotonic() - t0:.1f}s)")
    if config.lora.adapter_root is not None:
        return str(model_dir), config.lora.adapter_root
    t0 = time.monotonic()
    root = ensure_demo_adapters(model_dir, cache_dir / "demo-adapters")
    _say(out, f"  demo adapters: {root} ({time.monotonic() - t0:.1f}s)")
    return str(model_dir), str(root)


class TritonServer(ServerUrls):
    """One tritonserver process serving the vlora model."""

    def __init__(self, options: ServeOptions, out: TextIO = sys.stdout) -> None:
        self.options = options
        self._out = out
        self._proc: Optional[subprocess.Popen] = None
        self._workspace: Optional[Path] = None
        self._temporary_workspace = options.workspace is None
        self._log_path: Optional[Path] = None
        self._stopping = False
        self._restricted_value: Optional[str] = None  # the restricted APIs' header value (never printed)
        # Python backend shared-memory regions are named <prefix><uuid>: ours alone start with this.
        self.shm_prefix = f"vlora_{uuid.uuid4().hex[:12]}_"
        self._stub_pids: list[int] = []
        self._log_offset = 0
        self.engine_failure: Optional[str] = None  # the cause, once the model's engine failed
        self.engine_config = options.engine
        self.model_dir: Optional[str] = options.engine.model.path
        self.adapter_root: Optional[str] = options.engine.lora.adapter_root
        self._openai: Optional[OpenAIFrontendProcess] = None  # the OpenAI front end's process
        self.openai_failure: Optional[str] = None  # why the OpenAI front end stopped while serving
        # Where clients reach it (ServerUrls: http_url, grpc_url, metrics_url, openai_url).
        self.url_host = options.client_host
        self.http_port, self.grpc_port = options.http_port, options.grpc_port
        self.metrics_port, self.openai_port = options.metrics_port, options.openai_port
        self.model_names: list[str] = [MODEL_NAME]  # every model of the repository: the router and its engines when routed

    @property
    def log_path(self) -> Optional[Path]:
        return self._log_path

    def start(self) -> None:
        """Prepare everything, start tritonserver, and return once it is ready (or raise LaunchError)."""
        opts = self.options
        dist = TritonDistribution.locate()
        enough, shm = shm_room()
        if not enough:
            _say(self._out, f"warning: {shm}")
        for port in (opts.http_port, opts.grpc_port, opts.metrics_port) + ((opts.openai_port,) if opts.openai_port else ()):
            _check_port_free(opts.host, port)
        source = opts.model_repository or source_repository()
        template_path = source / MODEL_NAME / "config.pbtxt"
        if not template_path.is_file():
            raise LaunchError(
                f"model repository not found at {source} (expected {template_path}); "
                "run from a source checkout or pass --model-repository"
            )
        if opts.prepare_defaults:
            self.model_dir, self.adapter_root = prepare_default_artifacts(opts.engine, self._out)

        if opts.workspace is None:
            self._workspace = Path(tempfile.mkdtemp(prefix="vlora-serve-"))
        else:
            self._workspace = opts.workspace
            if not self._workspace.exists():  # a folder we create is private; the operator's own is left as it is
                self._workspace.parent.mkdir(parents=True, exist_ok=True)
                self._workspace.mkdir(mode=0o700)
        ws = self._workspace
        binary, backends = dist.install(ws / "tritonserver")
        repo = self._prepare_models(source, template_path.read_text(encoding="utf-8"), ws)
        self._log_path = ws / "tritonserver.log"
        cmd = self.command(binary, backends, repo)
        _say(self._out, f"starting tritonserver (workspace {ws}, log {self._log_path})")
        # The log may hold prompts (at a high --log-verbose): its user's only, also when it already existed.
        fd = os.open(self._log_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        os.fchmod(fd, 0o600)
        log = os.fdopen(fd, "wb")
        try:
            self._proc = subprocess.Popen(
                cmd,
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                env=server_environment(dist),
                cwd=str(ws),
                start_new_session=True,  # a terminal's Ctrl-C reaches us; we forward it once
                preexec_fn=_server_child_setup,  # dies with us; boost's fchmod(fd, 0644) is a no-op
                umask=SERVER_UMASK,  # files and shared-memory regions (prompts, images): 0600
            )
        finally:
            log.close()
        self._hide_admin_key()
        self._wait_ready()
        self._check_restricted()
        self._check_regions_private()
        if opts.openai_port:
            self._start_openai()

    def _prepare_models(self, source: Path, template: str, ws: Path) -> Path:
        """The workspace's model repository: one ``vlora`` model, or the router and one engine model per GPU."""
        opts = self.options
        device = self.engine_config.model.device
        engines = routed_engines(opts.routing, device, visible_gpus(device), opts.routing_cpu_engines)
        overrides = flat_overrides(self.engine_config)
        if not engines:
            config_text = render_config(template, parameters=overrides, instance_group=instance_group_for(device))
            return prepare_repository(source, ws / "model_repository", config_text)
        board = create_board(ws / "routing.board", engines)
        names = [engine_model_name(i) for i in range(engines)]
        engine_configs = [
            render_config(template, parameters={**overrides, BOARD_PARAM: str(board), SLOT_PARAM: str(i)},
                          instance_group=engine_instance_group(i, device))
            for i in range(engines)
        ]
        router_config = render_config(
            "# The router of adapter-aware routing (vlora.server.routing.router), written by `vlora serve`.\n" + template,
            parameters={ENGINES_PARAM: ",".join(names), BOARD_PARAM: str(board), MARGIN_PARAM: str(opts.routing_margin)},
            instance_group=router_instance_group(opts.router_instances))
        self.model_names = [MODEL_NAME, *names]
        _say(self._out, f"adapter-aware routing: {engines} engine models ({', '.join(names)}) behind the router "
                        f"'{MODEL_NAME}' ({opts.router_instances} CPU instances; --routing off turns it off)")
        return prepare_routed_repository(source, ws / "model_repository", engine_configs, router_config)

    def command(self, binary: Path, backends: Path, repo: Path) -> list[str]:
        """tritonserver's command line (the restricted APIs' value is chosen here, once per launch)."""
        opts = self.options
        if self._restricted_value is None:
            token_file = self.engine_config.lora.admin_token_file
            self._restricted_value = (triton_admin_key(read_admin_token(token_file)) if token_file
                                      else unsendable_value())
        return [
            str(binary),
            f"--model-repository={repo}",
            f"--backend-directory={backends}",
            f"--http-port={opts.http_port}",
            f"--grpc-port={opts.grpc_port}",
            f"--metrics-port={opts.metrics_port}",
            f"--http-address={opts.host}",
            f"--grpc-address={opts.host}",
            f"--metrics-address={opts.host}",
            f"--log-verbose={opts.log_verbose}",
            f"--exit-timeout-secs={opts.exit_timeout_s}",
            "--allow-gpu-metrics=false",
            f"--backend-config=python,shm-region-prefix-name={self.shm_prefix}",
            *restricted_api_flags(self._restricted_value),
        ]

    def _start_openai(self) -> None:
        """Start the OpenAI front end (tritonserver is ready) and wait until it answers /health; else stop
        everything and raise LaunchError with its output."""
        self._openai = OpenAIFrontendProcess(self.options, self._workspace, self.grpc_url, MODEL_NAME, self.model_dir)
        try:
            self._openai.start()
        except FrontendStartError as e:
            self.stop()
            raise LaunchError(f"the OpenAI API front end {e} (--openai-port 0 turns it off).\n"
                              f"--- {self._openai.log_path} ---\n{self.openai_log_tail()}") from None

    def openai_log_tail(self, lines: int = 20) -> str:
        return self._openai.log_tail(lines) if self._openai is not None else ""

    def _stop_openai(self, sig: int = signal.SIGTERM) -> None:
        if self._openai is not None:
            self._openai.stop(sig)

    def _hide_admin_key(self) -> None:
        """Overwrite the restricted APIs' value on tritonserver's command line (/proc/PID/cmdline, which other
        local users can read) once tritonserver has parsed it. Its first log line comes after the parse; if the
        overwrite came first all the same, Triton would expect line feeds, which no client can send: the
        restricted APIs would be off, never open (_check_restricted says so)."""
        deadline = time.monotonic() + ARGV_HIDE_WAIT_S
        while (self._proc.poll() is None and time.monotonic() < deadline
               and not (self._log_path.exists() and self._log_path.stat().st_size > 0)):
            time.sleep(0.002)
        if self._proc.poll() is not None:
            return
        try:
            hidden = hide_argument_value(self._proc.pid, self._restricted_value)
        except OSError as e:
            hidden = 0
            reason = f"{type(e).__name__}: {e}"
        else:
            reason = "not found"
        if not hidden:
            _say(self._out, f"warning: could not hide the admin key on tritonserver's command line ({reason}); "
                            f"local users can read it in /proc/{self._proc.pid}/cmdline")

    def _check_regions_private(self) -> None:
        """Fail-safe: the shared-memory regions are 0600 (the seccomp filter of _server_child_setup keeps boost's
        fchmod from opening them). Where it could not be installed, they are made 0600 now, with a warning:
        a local user may have opened one in the meantime."""
        opened = []
        for region in SHM_DIR.glob(f"{self.shm_prefix}*"):
            try:
                if region.stat().st_mode & 0o077:
                    os.chmod(region, 0o600)
                    opened.append(region.name)
            except OSError:
                pass
        if opened:
            _say(self._out, f"warning: tritonserver created its shared-memory regions readable by other users "
                            f"({', '.join(opened)}); they are 0600 now, but a local user may have opened them before")

    def _check_restricted(self) -> None:
        """Fail-safe: Triton's restricted APIs refuse a request without the key (else stop: LaunchError), and
        answer the key when there is an admin token (else a warning: they are off for this launch)."""
        url = f"{self.http_url}/v2/logging"
        if _http_status(url) != 403:
            self.stop()
            raise LaunchError("tritonserver answered its logging API without the admin key: "
                              "its restricted APIs are open, so it was stopped")
        if self.engine_config.lora.admin_token_file and _http_status(
                url, {ADMIN_KEY_HEADER: self._restricted_value}) != 200:
            _say(self._out, "warning: tritonserver refuses the admin key: Triton's shared-memory, logging, trace "
                            "and model-repository APIs are off for this launch")

    def _wait_ready(self) -> None:
        opts = self.options
        t0 = time.monotonic()
        last_report = t0
        urls = [f"{self.http_url}/v2/models/{name}/ready" for name in self.model_names]
        while True:
            code = self._proc.poll()
            if code is not None:
                raise LaunchError(f"tritonserver exited with code {code} before it was ready.\n{self.failure_report()}")
            if all(_http_ok(url) for url in urls):
                break
            now = time.monotonic()
            if now - t0 > opts.startup_timeout_s:
                self.stop()
                raise LaunchError(f"tritonserver was not ready after {opts.startup_timeout_s:.0f}s.\n{self.failure_report()}")
            if now - last_report >= 5.0:
                last_report = now
                _say(self._out, f"  waiting for the model to load ({now - t0:.0f}s) {self._progress_line()}")
            time.sleep(0.25)
        self._stub_pids = self.stub_pids()
        _say(self._out, f"tritonserver is ready ({time.monotonic() - t0:.1f}s)")

    def _progress_line(self) -> str:
        """The newest vlora line of the server log, to show what loading is doing."""
        for line in reversed(self.log_tail(200).splitlines()):
            if "vlora" in line:
                return "| " + line.split('] ', 1)[-1].split("\\n")[0].strip().strip('"')[:160]
        return ""

    def failure_report(self) -> str:
        """Why the server failed: the model's load error when there is one, else the log's errors and tail."""
        text = self.log_tail(3000)
        for line in reversed(text.splitlines()):
            m = re.search(r"failed to load '[^']+' version \d+: (.*)", line)
            if m:
                reason = m.group(1).split("\\n\\nAt:")[0].removeprefix("Internal: ").rstrip('"')
                return f"the model failed to load: {reason}\n(the whole log: {self._log_path})"
        errors = [ln for ln in text.splitlines()
                  if (ln.startswith("E") and ln[1:5].isdigit() or "Error:" in ln) and "CudaDriverHelper" not in ln]
        parts = []
        if errors:
            parts.append(f"--- errors in {self._log_path} ---")
            parts.extend(e[:800] for e in errors[-8:])
        parts.append(f"--- last lines of {self._log_path} ---")
        parts.append(self.log_tail(25))
        return "\n".join(parts)

    def log_tail(self, lines: int = 40) -> str:
        if self._log_path is None or not self._log_path.exists():
            return ""
        with open(self._log_path, "rb") as fh:
            fh.seek(0, os.SEEK_END)
            size = fh.tell()
            fh.seek(max(0, size - 256 * 1024))
            text = fh.read().decode("utf-8", errors="replace")
        return "\n".join(text.splitlines()[-lines:])

    def banner(self) -> str:
        return serving_banner(self.options, self.engine_config, self.model_dir, self.adapter_root, self.http_url,
                              self.grpc_url, self.metrics_url, self.openai_url, self._log_path)

    def serve_forever(self) -> int:
        """Print the banner, then wait for the server; SIGINT/SIGTERM drain and stop it."""
        _say(self._out, self.banner())

        def forward(signum, _frame):
            if not self._stopping:
                self._stopping = True
                _say(self._out, f"received {signal.Signals(signum).name}: draining in-flight requests and stopping ...")
                self._stop_openai()
                self._signal(signal.SIGTERM)
            else:
                _say(self._out, "second signal: killing tritonserver")
                self._signal(signal.SIGKILL)

        signal.signal(signal.SIGINT, forward)
        signal.signal(signal.SIGTERM, forward)
        if self._log_path is not None and self._log_path.exists():
            self._log_offset = self._log_path.stat().st_size
        kill_at: Optional[float] = None
        while True:
            try:
                code = self._proc.wait(timeout=POLL_S)
                break
            except subprocess.TimeoutExpired:
                pass
            self._watch_engine()
            if self._openai is not None and not self._stopping and self._openai.poll() is not None:
                self.openai_failure = f"the OpenAI API front end exited with code {self._openai.returncode}"
                self._stopping = True
                _say(self._out, f"vlora serve: {self.openai_failure}:\n{self.openai_log_tail()}\n"
                                "stopping tritonserver (restart vlora serve; --openai-port 0 turns the front end off) ...")
                self._signal(signal.SIGTERM)
            if self.engine_failure is not None and not self._stopping:
                self._stopping = True
                _say(self._out, f"vlora serve: the engine failed: {self.engine_failure}\n"
                                "stopping tritonserver (the model cannot serve any more) ...")
                self._signal(signal.SIGTERM)
                kill_at = time.monotonic() + DEAD_STUB_GRACE_S
            if self._stopping and kill_at is None:
                kill_at = time.monotonic() + self.options.exit_timeout_s + KILL_MARGIN_S
            if kill_at is not None and time.monotonic() > kill_at:
                _say(self._out, "tritonserver did not stop in time: killing it and its stub processes")
                self._kill_group()
                kill_at = float("inf")
        if self.engine_failure is not None:
            self._cleanup(False)
            _say(self._out, f"tritonserver stopped after the engine failed (log: {self._log_path})")
            return ENGINE_FAILED_EXIT
        if self.openai_failure is not None:
            self._cleanup(False)
            _say(self._out, f"tritonserver stopped after the OpenAI front end failed (its log: {self._openai.log_path})")
            return OPENAI_FAILED_EXIT
        if code != 0 and not self._stopping:
            _say(self._out, f"tritonserver exited with code {code}.\n{self.failure_report()}")
        elif code != 0:
            _say(self._out, f"tritonserver stopped with code {code} (log: {self._log_path})")
        else:
            _say(self._out, "tritonserver stopped")
        self._cleanup(code == 0)
        return 0 if self._stopping and code in (0, -signal.SIGTERM) else code

    def _signal(self, sig: int) -> None:
        if sig == signal.SIGKILL:
            self._kill_group()
            return
        if self._proc is not None and self._proc.poll() is None:
            try:
                self._proc.send_signal(sig)
            except ProcessLookupError:
                pass

    def _kill_group(self) -> None:
        """SIGKILL tritonserver and everything it started (its stubs share its process group)."""
        if self._proc is None:
            return
        try:
            os.killpg(self._proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass

    def stub_pids(self) -> list[int]:
        """The Python backend stub processes of this server (its children named like the stub)."""
        if self._proc is None:
            return []
        return [pid for pid, name, _ in child_processes(self._proc.pid) if name and STUB_NAME.startswith(name)]

    def _watch_engine(self) -> None:
        """Forward the model's ENGINE FAILED lines; notice a stub that died (engine_failure is set)."""
        for line in self._new_log_lines():
            if ENGINE_FAILED_MARK in line:
                cause = line.split(ENGINE_FAILED_MARK, 1)[1].lstrip(": ").rstrip('"')
                self.engine_failure = cause
                _say(self._out, f"{ENGINE_FAILED_MARK}: {cause}")
        if self.engine_failure is None and not self._stopping and self._stub_pids and any(not _alive(p) for p in self._stub_pids):
            self.engine_failure = (f"the model's stub process exited unexpectedly (see {self._log_path})")

    def _new_log_lines(self) -> list[str]:
        if self._log_path is None or not self._log_path.exists():
            return []
        with open(self._log_path, "rb") as fh:
            fh.seek(self._log_offset)
            data = fh.read()
        end = data.rfind(b"\n") + 1  # a partial last line is read next time
        self._log_offset += end
        return data[:end].decode("utf-8", errors="replace").splitlines()

    def stop(self, timeout: float = 60.0) -> int:
        """Drain and stop the server (SIGTERM, then SIGKILL after ``timeout``). Returns its exit code."""
        if self._proc is None:
            return 0
        self._stopping = True
        self._stop_openai()
        self._signal(signal.SIGTERM)
        try:
            code = self._proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self._kill_group()
            code = self._proc.wait()
        self._cleanup(code == 0)
        return code

    def _cleanup(self, clean: bool) -> None:
        """After tritonserver exited: kill what it left running (stubs that outlived it) and remove its
        shared-memory regions; remove a temporary workspace after a clean exit. The OpenAI front end, told to
        stop with the server, gets a few seconds more to finish its answers."""
        if self._openai is not None:
            self._openai.reap(timeout=10.0)
        self._kill_group()
        for region in SHM_DIR.glob(f"{self.shm_prefix}*"):
            try:
                region.unlink()
            except OSError:
                pass
        if clean and self._temporary_workspace and self._workspace is not None:
            shutil.rmtree(self._workspace, ignore_errors=True)

    def __enter__(self) -> "TritonServer":
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


def shm_room(path: Path = SHM_DIR) -> tuple[bool, str]:
    """Whether ``path`` (/dev/shm) has room for serving, and what it has. The Python backend passes every request (its
    images too), every response and every BLS call of the router through shared-memory regions there; a container's
    default (64 MB in Docker) runs out under load."""
    try:
        st = os.statvfs(path)
    except OSError as e:
        return False, f"{path} cannot be read ({e}): Triton's Python backend needs it"
    free = st.f_bavail * st.f_frsize
    if free >= SHM_LOW_BYTES:
        return True, f"{path}: {free / 2**30:.1f} GiB free"
    return False, (f"{path} has {free / 2**20:.0f} MiB free: Triton's Python backend passes requests, images and "
                   f"responses through it; give it 1 GiB or more (in a container: --shm-size=1g or larger)")


def _say(out: TextIO, text: str) -> None:
    out.write(text + "\n")
    out.flush()


# glibc's threshold above which malloc maps a block of its own (given back when freed), fixed for tritonserver
# and the stub it starts: its default grows with the largest block freed, up to 32 MiB, so a flood of large
# requests left their HTTP bodies' memory in tritonserver's heap (RssAnon 5 -> 225 MiB after 24 requests of
# 8 images, 12 at a time, on the 2-core CPU; 5.6 MiB with this). A value in the environment is kept.
MMAP_THRESHOLD = 1 << 20


def server_environment(dist) -> dict[str, str]:
    """tritonserver's environment: the distribution's (library path, this interpreter) and glibc's mmap threshold."""
    env = dist.environment(dict(os.environ))
    env.setdefault("MALLOC_MMAP_THRESHOLD_", str(MMAP_THRESHOLD))
    return env


def visible_gpus(device: str) -> int:
    """The GPUs a device setting of ``auto`` or ``cuda`` reaches (torch's count: CUDA_VISIBLE_DEVICES applies);
    0 for any other setting, or without torch or CUDA."""
    if device not in ("auto", "cuda"):
        return 0
    try:
        import torch
    except ImportError:
        return 0
    try:
        return int(torch.cuda.device_count())
    except Exception:
        return 0


def _check_port_free(host: str, port: int) -> None:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host if host not in ("", "::") else "0.0.0.0", port))
        except OSError as e:
            raise LaunchError(f"port {port} on {host} is not free ({e.strerror}); choose another with the port flags") from None
