"""``vlora loadtest``: run a workload against a vlora server with locust, headless, and write a report.

    vlora loadtest --workload video --rate 4 --duration 60                 # starts a server on loopback
    vlora loadtest --workload visual_retrieval --rate 1,2,4,8 --url 127.0.0.1:8000   # uses a running server
    vlora loadtest --workload visual_retrieval --skewness 0.1,0.3,0.6,0.9 --num-adapters 16

Without ``--url`` it starts ``vlora serve`` on free loopback ports (``--model``, ``--adapters``,
``--device`` and any ``--serve-arg`` are passed on), and stops it at the end. The results folder has
``requests.csv`` (one row per request), ``server_timeline.csv``, locust's CSVs, ``summary.json``, PNG
plots and ``report.md``; a sweep (several rates or skewness values) adds one folder per point and a
sweep page with latency against rate and against skewness.
"""
from __future__ import annotations

import argparse
import shlex
import sys
from pathlib import Path
from typing import Optional

from vlora.config import ConfigError
from vlora_load.heads import HeadPolicy
from vlora_load.runner import Target, default_out_dir, run_sweep, sweep_points
from vlora_load.workload import PROTOCOLS, Workload, resolve_workload
from vlora.server.ports import free_ports


def _floats(text: str) -> list[float]:
    try:
        return [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated numbers, got {text!r}") from None


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--workload", default="visual_retrieval",
                        help="a name in configs/workloads (visual_retrieval, video, mixed, smoke) or a YAML path")
    parser.add_argument("--rate", type=_floats, default=[], metavar="R[,R...]",
                        help="open-loop request rate(s), req/s; several make a sweep (default: the workload's)")
    parser.add_argument("--users", type=int, help="closed loop with N users instead of an open-loop rate")
    parser.add_argument("--duration", type=float, help="seconds of sending per point (default: the workload's)")
    parser.add_argument("--skewness", type=_floats, default=[], metavar="S[,S...]",
                        help="share of the most popular adapter; several make a sweep")
    parser.add_argument("--zipf", type=float, metavar="ALPHA", help="Zipf(alpha) adapter popularity instead of skewness")
    parser.add_argument("--num-adapters", type=int, help="adapters the requests spread over (1 to 1000)")
    parser.add_argument("--protocol", choices=PROTOCOLS, help="for every application (default: the workload's)")
    parser.add_argument("--seed", type=int)
    parser.add_argument("--length-scale", type=float, help="multiply the prompt and answer lengths (e.g. 0.05 for the tiny model)")
    parser.add_argument("--image-size", type=int, help="side of the generated images in pixels")
    parser.add_argument("--frames-per-chunk", type=int, help="frames per video chunk (the server accepts limits.max_images)")
    parser.add_argument("--request-timeout", type=float, help="seconds before a request counts as timed out")
    parser.add_argument("--out", metavar="DIR", help="results folder (default: .work/loadtest/<workload>-<time>)")
    parser.add_argument("--title", help="title of the sweep page")
    parser.add_argument("--report", metavar="DIR", help="only rebuild the reports under DIR from its raw files "
                        "(e.g. results copied back from a machine without matplotlib); sends nothing")
    target = parser.add_argument_group("server (default: start one on loopback)")
    target.add_argument("--url", metavar="HOST:PORT", help="a running server's HTTP address; gRPC is PORT+1, metrics PORT+2 unless given")
    target.add_argument("--grpc-url", metavar="HOST:PORT")
    target.add_argument("--metrics-url", metavar="URL", help="e.g. http://host:8002/metrics")
    target.add_argument("--adapter-names", metavar="A,B,...", help="adapters of a --url server (default: read from --adapters, else the demo adapters)")
    target.add_argument("--model", metavar="DIR", help="model of the started server (default: the tiny model)")
    target.add_argument("--adapters", metavar="DIR", help="adapter root: served by the started server; read for names and task heads")
    target.add_argument("--device", help="device of the started server (auto, cpu, cuda)")
    target.add_argument("--serve-arg", action="append", default=[], metavar="ARG",
                        help="more `vlora serve` arguments, e.g. --serve-arg='--max-queue-size 16' (repeatable)")
    target.add_argument("--adapter-rank", type=int, default=8, help="rank of the adapters --num-adapters writes (default 8)")
    target.add_argument("--no-heads", action="store_true", help="never use task heads, even where adapters declare them")
    target.add_argument("--grpc-workers", type=int, default=256, help="gRPC requests in flight at once (worker threads)")


def workload_from_args(args) -> Workload:
    workload = Workload.from_yaml(resolve_workload(args.workload))
    names = tuple(n.strip() for n in args.adapter_names.split(",") if n.strip()) if args.adapter_names else None
    return workload.with_overrides(
        rate=args.rate[0] if len(args.rate) == 1 else None,
        users=args.users,
        mode="closed" if args.users else ("open" if args.rate else None),
        duration_s=args.duration,
        skewness=args.skewness[0] if len(args.skewness) == 1 else None,
        zipf_alpha=args.zipf,
        num_adapters=args.num_adapters,
        protocol=args.protocol,
        seed=args.seed,
        length_scale=args.length_scale,
        image_size=args.image_size,
        request_timeout_s=args.request_timeout,
        adapter_names=names,
        frames_per_chunk=args.frames_per_chunk,
    )


def run(args: argparse.Namespace) -> int:
    out = sys.stdout
    import importlib.util

    if args.report:
        from vlora_load.runner import rebuild_reports

        if rebuild_reports(Path(args.report), out) == 0:
            print(f"vlora loadtest: no runs (plan.json) under {args.report}", file=sys.stderr)
            return 2
        return 0

    missing = [m for m in ("locust", "tritonclient") if importlib.util.find_spec(m) is None]
    if missing:
        print(f"vlora loadtest: {', '.join(missing)} not installed; pip install -e \".[load]\"", file=sys.stderr)
        return 2
    try:
        workload = workload_from_args(args)
        if workload.arrivals.mode == "closed" and len(args.rate) > 1:
            raise ConfigError("--rate sweeps need an open loop; drop --users")
        points = sweep_points(args.rate if len(args.rate) > 1 else [], args.skewness if len(args.skewness) > 1 else [])
        out_dir = Path(args.out) if args.out else default_out_dir(workload.name)
        server = None
        if args.url:
            target = Target.from_url(args.url, args.grpc_url, args.metrics_url)
            adapter_root = args.adapters
            names = list(workload.adapter_names) or _names_from(adapter_root) or _demo_names()
        else:
            server, adapter_root, names = start_server(args, workload, out_dir, out)
            target = Target(server.http_url.replace("http://", ""), server.grpc_url, server.metrics_url)
        heads = HeadPolicy.none() if args.no_heads else HeadPolicy.from_adapter_root(adapter_root, tuple(names))
        settings = {"command": "vlora loadtest " + " ".join(shlex.quote(a) for a in sys.argv[2:]),
                    "adapters": f"{len(names)} available, first: {', '.join(names[:4])}"}
        try:
            run_sweep(workload, points, target, out_dir, names, heads, out=out, grpc_workers=args.grpc_workers,
                      settings=settings, title=args.title)
        finally:
            if server is not None:
                out.write("stopping the server ...\n")
                server.stop()
    except (ConfigError, RuntimeError, FileNotFoundError) as e:
        print(f"vlora loadtest: {e}", file=sys.stderr, flush=True)
        return 2
    except KeyboardInterrupt:
        print("vlora loadtest: interrupted", file=sys.stderr, flush=True)
        return 130
    print(f"results: {out_dir}")
    return 0


def _names_from(adapter_root: Optional[str]) -> list[str]:
    from vlora.server.launcher import list_adapter_names

    return list_adapter_names(adapter_root)


def _demo_names() -> list[str]:
    from vlora.lora.demo import DEMO_ADAPTER_NAMES

    return list(DEMO_ADAPTER_NAMES)


def start_server(args, workload: Workload, out_dir: Path, out):
    """`vlora serve` on free loopback ports, through the launcher; writes --num-adapters adapters first."""
    from vlora.config import default_cache_dir
    from vlora.server import launcher

    http_port, grpc_port, metrics_port = free_ports(3)
    serve_argv = ["--host", "127.0.0.1", "--http-port", str(http_port), "--grpc-port", str(grpc_port),
                  "--metrics-port", str(metrics_port), "--openai-port", "0",  # the harness speaks Triton's APIs
                  "--workspace", str((out_dir / "server").resolve())]
    for flag, value in (("--model", args.model), ("--adapters", args.adapters), ("--device", args.device)):
        if value:
            serve_argv += [flag, value]
    for extra in args.serve_arg:
        serve_argv += shlex.split(extra)
    parser = argparse.ArgumentParser(prog="vlora serve")
    launcher.add_arguments(parser)
    serve_args = parser.parse_args(serve_argv)

    wanted = workload.popularity.num_adapters
    if args.num_adapters and not workload.adapter_names:
        options = launcher.options_from_args(serve_args)
        model_dir = options.engine.model.path
        if model_dir is None:
            from vlora.models.tiny import ensure_tiny_model

            cache = Path(options.engine.model.cache_dir) if options.engine.model.cache_dir else default_cache_dir()
            model_dir = ensure_tiny_model(cache)
        root = Path(args.adapters) if args.adapters else out_dir / "adapters"
        existing = _names_from(str(root))
        if len(existing) < wanted:
            from vlora_load.adapters import ensure_load_adapters

            out.write(f"writing {wanted} random rank-{args.adapter_rank} adapters into {root} ...\n")
            out.flush()
            ensure_load_adapters(Path(model_dir), root, wanted, rank=args.adapter_rank)
        serve_args = parser.parse_args(serve_argv + ["--adapters", str(root.resolve())])
    options = launcher.options_from_args(serve_args)
    server = launcher.TritonServer(options, out=out)
    server.start()
    names = list(workload.adapter_names) or launcher.list_adapter_names(server.adapter_root) or _demo_names()
    if args.num_adapters and not workload.adapter_names:
        from vlora_load.adapters import LOAD_ADAPTER_PREFIX

        load_names = [n for n in names if n.startswith(LOAD_ADAPTER_PREFIX)]
        names = load_names or names
    out.write(f"server ready: HTTP {server.http_url}, gRPC {server.grpc_url}, metrics {server.metrics_url}; "
              f"{len(names)} adapter(s)\n")
    out.flush()
    return server, server.adapter_root, names
