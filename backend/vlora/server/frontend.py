"""The OpenAI front end's process, as ``vlora serve`` runs it (issue 39; the front end itself is vlora.server.openai).

``OpenAIFrontendProcess`` starts ``python -m vlora.server.openai`` once tritonserver is ready (on the launcher's
``--host`` and ``--openai-port``, pointed at tritonserver's gRPC port and metrics endpoint (served as its
``/metrics``), told the checkpoint's family and folder name),
its output in ``openai.log`` in the workspace (0600), and waits until it answers ``/health``; it dies with the
launcher, is told to stop with the server (SIGTERM: it finishes its in-flight answers) and killed if it takes too
long. The launcher (TritonServer) watches it while serving and stops the server when it exits.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Optional

from vlora.server.http_probe import http_status
from vlora.server.lockdown import SERVER_UMASK, _die_with_parent
from vlora.server.options import ServeOptions

OPENAI_READY_TIMEOUT_S = 60.0  # how long the OpenAI front end may take to answer /health


class FrontendStartError(RuntimeError):
    """The front end exited or did not answer /health in time; the message says which (its log is not stopped)."""


class OpenAIFrontendProcess:
    """One OpenAI front end process of a launch."""

    def __init__(self, options: ServeOptions, workspace: Path, grpc_url: str, model: str,
                 model_dir: Optional[str]) -> None:
        self.options = options
        self.workspace = workspace
        self.grpc_url = grpc_url
        self.model = model
        self.model_dir = model_dir
        self.proc: Optional[subprocess.Popen] = None
        self.log_path: Optional[Path] = None

    def command(self) -> list[str]:
        opts = self.options
        family, checkpoint = _model_family(self.model_dir)
        cmd = [sys.executable, "-m", "vlora.server.openai", "--host", opts.host, "--port", str(opts.openai_port),
               "--grpc-url", self.grpc_url, "--metrics-url", f"http://{opts.client_host}:{opts.metrics_port}/metrics",
               "--model", self.model, "--family", family,
               "--max-body-bytes", str(opts.openai_max_body_bytes), "--graceful-timeout", str(opts.exit_timeout_s)]
        if checkpoint:
            cmd += ["--checkpoint", checkpoint]
        if opts.allow_image_urls:
            cmd.append("--allow-image-urls")
        return cmd

    def start(self) -> None:
        """Start the front end and wait until it answers /health; else FrontendStartError saying why (the caller
        stops everything, this process included)."""
        opts, ws = self.options, self.workspace
        cmd = self.command()
        self.log_path = ws / "openai.log"
        fd = os.open(self.log_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        os.fchmod(fd, 0o600)
        log = os.fdopen(fd, "wb")
        try:
            self.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                         cwd=str(ws), start_new_session=True, preexec_fn=_die_with_parent,
                                         umask=SERVER_UMASK)
        finally:
            log.close()
        url = f"http://{opts.client_host}:{opts.openai_port}/health"
        deadline = time.monotonic() + OPENAI_READY_TIMEOUT_S
        while http_status(url) != 200:
            code = self.proc.poll()
            if code is not None or time.monotonic() > deadline:
                why = f"exited with code {code}" if code is not None else f"did not answer {url} in {OPENAI_READY_TIMEOUT_S:.0f}s"
                raise FrontendStartError(why)
            time.sleep(0.1)

    def poll(self) -> Optional[int]:
        """Its exit code once it exited, else None (also when it was never started)."""
        return self.proc.poll() if self.proc is not None else None

    @property
    def returncode(self) -> Optional[int]:
        return self.proc.returncode if self.proc is not None else None

    def log_tail(self, lines: int = 20) -> str:
        if self.log_path is None or not self.log_path.exists():
            return ""
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])

    def stop(self, sig: int = signal.SIGTERM) -> None:
        if self.proc is not None and self.proc.poll() is None:
            try:
                self.proc.send_signal(sig)
            except ProcessLookupError:
                pass

    def reap(self, timeout: float) -> None:
        """Wait for the front end to end (it finishes its in-flight answers), then kill it."""
        if self.proc is None:
            return
        self.stop()
        try:
            self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


def _model_family(model_dir: Optional[str]) -> tuple[str, Optional[str]]:
    """(config.json's model_type, the folder's name) of the served checkpoint; ("llava", None) when unknown."""
    if not model_dir:
        return "llava", None
    try:
        model_type = json.loads((Path(model_dir) / "config.json").read_text(encoding="utf-8")).get("model_type")
    except (OSError, ValueError, AttributeError):
        model_type = None
    return (model_type if isinstance(model_type, str) and model_type else "llava"), Path(model_dir).name
