"""The options of one ``vlora serve`` launch: ServeOptions (the engine configuration and Triton's own
settings: ports, address, queue, workspace, timeouts), the command-line flags that set them (add_arguments)
and their reading (options_from_args: defaults, ``--config`` YAML, flags, ``--set``)."""
from __future__ import annotations

import argparse
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

from vlora.config import ConfigError, EngineConfig, read_admin_token


ROUTING_MODES = ("auto", "adapter", "off")


@dataclass(frozen=True)
class ServeOptions:
    """Everything one launch needs. Engine settings end up in ``engine``; the rest is Triton's."""

    engine: EngineConfig = field(default_factory=EngineConfig)
    http_port: int = 8000
    grpc_port: int = 8001
    metrics_port: int = 8002
    host: str = "127.0.0.1"  # loopback only unless the operator opens it (--host 0.0.0.0)
    workspace: Optional[Path] = None  # None: a temporary folder, removed after a clean exit
    model_repository: Optional[Path] = None  # None: model_repository/ of this checkout
    log_verbose: int = 0
    startup_timeout_s: float = 900.0
    exit_timeout_s: int = 30
    prepare_defaults: bool = True  # generate the tiny model / demo adapters up front
    # The OpenAI-compatible front end (vlora.server.openai), a process of its own on host:openai_port;
    # 0 (the default here; `vlora serve`'s flag defaults to 9000): not started.
    openai_port: int = 0
    openai_max_body_bytes: int = 64 * 1024 * 1024
    allow_image_urls: bool = False  # the front end fetches http(s) image_url parts (else only data: URLs)
    # Adapter-aware routing over the GPUs of this host (vlora.server.routing): "auto" routes when the device
    # setting reaches several GPUs, "adapter" likewise, "off" keeps one vlora model with one instance per GPU.
    routing: str = "auto"
    router_instances: int = 2  # CPU instances of the router model
    routing_margin: int = 8  # queue depth over the least loaded engine at which an engine counts as overloaded
    routing_cpu_engines: int = 0  # tests only: route over this many engine models on the CPU (--device cpu)

    def __post_init__(self) -> None:
        ports = [self.http_port, self.grpc_port, self.metrics_port]
        for p in ports:
            if not 0 < p < 65536:
                raise ConfigError(f"port {p} is out of range")
        if len(set(ports)) != 3:
            raise ConfigError(f"--http-port, --grpc-port and --metrics-port must differ, got {ports}")
        if not 0 <= self.openai_port < 65536:
            raise ConfigError(f"--openai-port {self.openai_port} is out of range (0 turns the OpenAI API off)")
        if self.openai_port and self.openai_port in ports:
            raise ConfigError(f"--openai-port {self.openai_port} is one of the other ports {ports}")
        if self.openai_max_body_bytes < 1024:
            raise ConfigError("--openai-max-body-mib must allow at least 1 KiB")
        if self.routing not in ROUTING_MODES:
            raise ConfigError(f"--routing must be one of {list(ROUTING_MODES)}, got {self.routing!r}")
        if not 1 <= self.router_instances <= 64:
            raise ConfigError("--router-instances must be 1 to 64")
        if self.routing_margin < 0:
            raise ConfigError("--routing-margin must be >= 0")
        if self.routing_cpu_engines and not 1 <= self.routing_cpu_engines <= 16:
            raise ConfigError("--routing-cpu-engines must be 1 to 16")
        if self.routing_cpu_engines and self.engine.model.device != "cpu":
            raise ConfigError("--routing-cpu-engines runs engine models on the CPU: it needs --device cpu")

    @property
    def client_host(self) -> str:
        return "127.0.0.1" if self.host in ("0.0.0.0", "::", "") else self.host

    @property
    def listen_description(self) -> str:
        """Where the endpoints really listen, in words, for the banner."""
        if self.host in ("0.0.0.0", "::", ""):
            return f"{self.host or '0.0.0.0'} (all interfaces: any machine that can reach this one may send requests)"
        if self.host == "localhost" or self.host.startswith("127."):
            return f"{self.host} (this machine only; --host 0.0.0.0 opens it to others)"
        return self.host


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", metavar="DIR", help="local Hugging Face folder of a supported family: LLaVA-1.5, Qwen2-VL, Qwen2.5-VL (default: the embedded tiny random LLaVA)")
    parser.add_argument("--adapters", metavar="DIR", help="adapter root: one PEFT folder per adapter (default: the demo adapters)")
    parser.add_argument("--config", metavar="YAML", help="engine configuration file (see configs/serve/default.yaml)")
    parser.add_argument("--set", metavar="KEY=VALUE", action="append", default=[],
                        help="engine setting as section.field=value, e.g. --set scheduler.max_waiting=8 (repeatable)")
    parser.add_argument("--device", help="auto, cpu, cuda or cuda:N (default: auto)")
    parser.add_argument("--dtype", choices=["auto", "float32", "float16", "bfloat16"], help="weights and activations dtype")
    parser.add_argument("--max-batch-size", type=int, help="requests in one engine step (MaxBS)")
    parser.add_argument("--max-queue-size", type=int, help="requests queued for the engine; beyond them a request is "
                        "refused at once (scheduler.max_waiting, default 256)")
    parser.add_argument("--http-port", type=int, default=8000)
    parser.add_argument("--grpc-port", type=int, default=8001)
    parser.add_argument("--metrics-port", type=int, default=8002)
    parser.add_argument("--host", default="127.0.0.1",
                        help="address the three endpoints listen on (default: 127.0.0.1, this machine only; 0.0.0.0: all interfaces)")
    parser.add_argument("--openai-port", type=int, default=9000,
                        help="port of the OpenAI-compatible API (/v1/chat/completions, /v1/completions, /v1/models) on --host; "
                             "0 turns it off (default: 9000)")
    parser.add_argument("--openai-max-body-mib", type=float, default=64.0,
                        help="largest request body the OpenAI API accepts, in MiB (default: 64)")
    parser.add_argument("--allow-image-urls", action="store_true",
                        help="let the OpenAI API fetch http(s) image_url parts (within 16 MiB and 10 s each); "
                             "off: only data: URLs. The server then fetches any URL a client names")
    parser.add_argument("--admin-token-file", metavar="FILE",
                        help="enable adapter load/unload for requests carrying the token this file holds (admin_token); "
                             "without it they are refused (list stays open)")
    parser.add_argument("--workspace", metavar="DIR", help="where the server binary, model repository and log go (default: a temporary folder)")
    parser.add_argument("--model-repository", metavar="DIR", help="model repository to serve (default: model_repository/ of this checkout)")
    parser.add_argument("--log-verbose", type=int, default=0, help="tritonserver --log-verbose level")
    parser.add_argument("--routing", choices=ROUTING_MODES, default="auto",
                        help="with several GPUs: one engine model per GPU behind a router that sends each adapter's "
                             "requests to a GPU that has it (auto, the default, and adapter: on with 2+ GPUs; "
                             "off: one model with one instance per GPU)")
    parser.add_argument("--router-instances", type=int, default=2, help="CPU instances of the router model (default: 2)")
    parser.add_argument("--routing-margin", type=int, default=8,
                        help="requests of queue depth over the least loaded GPU beyond which a GPU holding the "
                             "adapter counts as overloaded and the adapter spreads (default: 8)")
    parser.add_argument("--routing-cpu-engines", type=int, default=0, help=argparse.SUPPRESS)  # tests: N CPU engines
    parser.add_argument("--startup-timeout", type=float, default=900.0, help="seconds to wait for the server to become ready")


def options_from_args(args: argparse.Namespace) -> ServeOptions:
    config = EngineConfig.from_yaml(args.config) if args.config else EngineConfig()
    flat: dict[str, object] = {}
    if args.model:
        flat["model.path"] = str(_existing_dir(args.model, "--model"))
    if args.adapters:
        flat["lora.adapter_root"] = str(_existing_dir(args.adapters, "--adapters"))
    if args.device:
        flat["model.device"] = args.device
    if args.dtype:
        flat["model.dtype"] = args.dtype
    if args.max_batch_size is not None:
        flat["scheduler.max_batch_size"] = args.max_batch_size
    if args.max_queue_size is not None:  # the ingress bound is the engine's queue (config.pbtxt has no batcher queue)
        if args.max_queue_size < 1:
            raise ConfigError("--max-queue-size must be >= 1")
        flat["scheduler.max_waiting"] = args.max_queue_size
    if getattr(args, "admin_token_file", None):
        path = Path(args.admin_token_file).expanduser().resolve()
        read_admin_token(path)  # refused now, not at model load, when unreadable or too short
        flat["lora.admin_token_file"] = str(path)
    for item in args.set:
        key, sep, value = item.partition("=")
        if not sep:
            raise ConfigError(f"--set expects KEY=VALUE, got {item!r}")
        flat[key.strip()] = value
    config = config.with_overrides(flat)
    return ServeOptions(
        engine=config,
        http_port=args.http_port,
        grpc_port=args.grpc_port,
        metrics_port=args.metrics_port,
        host=args.host,
        workspace=Path(args.workspace).resolve() if args.workspace else None,
        model_repository=Path(args.model_repository).resolve() if args.model_repository else None,
        log_verbose=args.log_verbose,
        startup_timeout_s=args.startup_timeout,
        openai_port=getattr(args, "openai_port", 0),
        openai_max_body_bytes=int(getattr(args, "openai_max_body_mib", 64.0) * 1024 * 1024),
        allow_image_urls=getattr(args, "allow_image_urls", False),
        routing=getattr(args, "routing", "auto"),
        router_instances=getattr(args, "router_instances", 2),
        routing_margin=getattr(args, "routing_margin", 8),
        routing_cpu_engines=getattr(args, "routing_cpu_engines", 0),
    )


def _existing_dir(path: str, flag: str) -> Path:
    p = Path(path).expanduser().resolve()
    if not p.is_dir():
        raise ConfigError(f"{flag} {path}: not a folder")
    return p
