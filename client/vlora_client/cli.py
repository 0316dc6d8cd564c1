"""``vlora-client``: send one prompt (with images or video frames) to a vlora server, or manage its
adapters (``vlora-client adapters list``, ``adapters load NAME``, ``adapters unload NAME``)."""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Optional, Sequence

from vlora_client.client import DEFAULT_MODEL, DEFAULT_URLS, VloraClient, VloraClientError, VloraConnectionError


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="vlora-client",
        description="Send a prompt and images to a vlora model on Triton. Several --image are the frames of a video. "
                    "`vlora-client adapters list|load NAME|unload NAME` manages the server's adapters.",
    )
    p.add_argument("command", nargs="*", metavar="adapters ACTION [NAME]",
                   help="adapters list | adapters load NAME | adapters unload NAME (instead of --prompt)")
    p.add_argument("--url", help=f"server address (default: {DEFAULT_URLS['grpc']} for grpc, {DEFAULT_URLS['http']} for http)")
    p.add_argument("--protocol", choices=["grpc", "http"], default="grpc")
    p.add_argument("--model", default=DEFAULT_MODEL, help="Triton model name")
    p.add_argument("--prompt", help="text_input; <image> marks where each image goes (else images come first)")
    p.add_argument("--image", action="append", default=[], metavar="FILE", help="image file (repeat for video frames)")
    p.add_argument("--lora", metavar="NAME", help="adapter name (default: the base model)")
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--temperature", type=float)
    p.add_argument("--top-p", type=float)
    p.add_argument("--seed", type=int)
    p.add_argument("--stop", action="append", metavar="TEXT", help="stop string (repeatable)")
    p.add_argument("--task", metavar="NAME", help="answer with the adapter's vision task head NAME (one prefill): "
                   "prints the label and the score of every label")
    p.add_argument("--chat-template", action="store_true", help="wrap the prompt in the model's chat template (server side)")
    p.add_argument("--latency-target", type=float, metavar="SECONDS",
                   help="this request's latency target: the scheduler runs it before it waits longer")
    p.add_argument("--stream", action="store_true", help="print tokens as they arrive")
    p.add_argument("--json", action="store_true", help="print the result as JSON")
    p.add_argument("--timeout", type=float, default=300.0, help="seconds to wait for the answer")
    p.add_argument("--admin-token-file", metavar="FILE",
                   help="adapters load/unload: send the token this file holds (the server's --admin-token-file)")
    return p


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = build_parser()
    args = parser.parse_intermixed_args(argv)
    admin_token = None
    if args.admin_token_file:
        try:  # a file keeps the token off the process list; surrounding whitespace is not part of it
            admin_token = Path(args.admin_token_file).read_text(encoding="utf-8").strip()
        except (OSError, UnicodeDecodeError) as e:
            print(f"vlora-client: --admin-token-file {args.admin_token_file}: cannot be read ({e})", file=sys.stderr)
            return 2
    client = VloraClient(args.url, protocol=args.protocol, model=args.model, timeout_s=args.timeout,
                         admin_token=admin_token)
    try:
        return _adapters(parser, client, args) if args.command else _generate(parser, client, args)
    except VloraConnectionError as e:
        print(f"vlora-client: {e}", file=sys.stderr)
        return 1
    except VloraClientError as e:
        print(f"vlora-client: server error: {e}", file=sys.stderr)
        return 1
    except OSError as e:
        print(f"vlora-client: {e}", file=sys.stderr)
        return 1


def _generate(parser: argparse.ArgumentParser, client: VloraClient, args) -> int:
    if args.prompt is None:
        parser.error("--prompt is required (or: adapters list|load NAME|unload NAME)")
    options = dict(images=args.image, lora_name=args.lora, max_tokens=args.max_tokens, temperature=args.temperature,
                   top_p=args.top_p, seed=args.seed, stop=args.stop, apply_chat_template=args.chat_template,
                   task=args.task, latency_target=args.latency_target)
    if args.stream and not args.json:
        finish = None
        scores = None
        for delta in client.generate_stream(args.prompt, **options):
            sys.stdout.write(delta.text)
            sys.stdout.flush()
            finish = delta.finish_reason or finish
            scores = delta.scores or scores
        sys.stdout.write("\n")
        if scores:
            print(_scores_table(scores))
        print(f"[finish_reason: {finish}]", file=sys.stderr)
        return 0
    result = client.generate(args.prompt, stream=args.stream, **options)
    if args.json:
        print(json.dumps(result.__dict__))
    else:
        print(result.text)
        if result.scores:
            print(_scores_table(result.scores))
        print(f"[finish_reason: {result.finish_reason}, input tokens: {result.num_input_tokens}, "
              f"output tokens: {result.num_output_tokens}]", file=sys.stderr)
    return 0


def _scores_table(scores: dict) -> str:
    """One line per label, most likely first: the score and a bar."""
    width = max(len(name) for name in scores)
    rows = sorted(scores.items(), key=lambda kv: -kv[1])
    return "\n".join(f"  {name:<{width}}  {p:6.1%}  {'#' * round(p * 40)}" for name, p in rows)


def _adapters(parser: argparse.ArgumentParser, client: VloraClient, args) -> int:
    cmd = args.command
    if cmd[0] != "adapters" or len(cmd) < 2 or cmd[1] not in ("list", "load", "unload") \
            or len(cmd) != (2 if cmd[1] == "list" else 3):
        parser.error(f"unknown command {' '.join(cmd)!r}; use: adapters list | adapters load NAME | adapters unload NAME")
    if cmd[1] == "list":
        result = client.list_adapters()
    elif cmd[1] == "load":
        result = client.load_adapter(cmd[2])
    else:
        result = client.unload_adapter(cmd[2])
    if args.json:
        print(json.dumps(result, indent=2))
    elif cmd[1] == "list":
        print(f"{'id':>4}  {'name':<32} {'tier':<8} {'loaded':<6} {'rank':>4}  {'running':>7} {'waiting':>7}")
        for a in result:
            print(f"{a['id']:>4}  {a['name']:<32} {a['tier']:<8} {'yes' if a['loaded'] else 'no':<6} "
                  f"{a['rank'] if a['rank'] is not None else '-':>4}  {a['running']:>7} {a['waiting']:>7}")
    else:
        done = "unloading (its requests in flight finish first)" if result.get("state") == "unloading" else f"{cmd[1]}ed"
        print(f"{done} {result['name']} (id {result['id']}, tier {result.get('tier', '-')})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
