"""Free TCP ports on loopback, for servers started by tests, benchmarks and load runs; a server's URLs."""
from __future__ import annotations

import socket
from typing import Optional


def free_ports(n: int) -> list[int]:
    """``n`` distinct ports that were free a moment ago (all held open together while choosing)."""
    socks, ports = [], []
    for _ in range(n):
        s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        s.bind(("127.0.0.1", 0))
        socks.append(s)
        ports.append(s.getsockname()[1])
    for s in socks:
        s.close()
    return ports


class ServerUrls:
    """The URLs of a ``vlora serve`` server, from ``url_host`` (where clients reach it) and its ports
    ``http_port``, ``grpc_port``, ``metrics_port`` and ``openai_port`` (0: the OpenAI API is off), which the
    class mixing this in provides. ``grpc_url`` is host:port, as gRPC clients take it."""

    url_host: str
    http_port: int
    grpc_port: int
    metrics_port: int
    openai_port: int

    @property
    def http_url(self) -> str:
        return f"http://{self.url_host}:{self.http_port}"

    @property
    def grpc_url(self) -> str:
        return f"{self.url_host}:{self.grpc_port}"

    @property
    def metrics_url(self) -> str:
        return f"http://{self.url_host}:{self.metrics_port}/metrics"

    @property
    def openai_url(self) -> Optional[str]:
        """The OpenAI API's base URL (``.../v1``, for ``openai.OpenAI(base_url=...)``), None when it is off."""
        return f"http://{self.url_host}:{self.openai_port}/v1" if self.openai_port else None
