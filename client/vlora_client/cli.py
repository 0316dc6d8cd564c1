"""``vlora-client``: send one prompt (with images or video frames) to a vlora server."""
from __future__ import annotations

import argparse
import json
import sys
from typing import Optional, Sequence

from vlora_client.client import DEFAULT_MODEL, DEFAULT_URLS, VloraClient, VloraClientError


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="vlora-client",
        description="Send a prompt and images to a vlora model on Triton. Several --image are the frames of a video.",
    )
    p.add_argument("--url", help=f"server address (default: {DEFAULT_URLS['grpc']} for grpc, {DEFAULT_URLS['http']} for http)")
    p.add_argument("--protocol", choices=["grpc", "http"], default="grpc")
    p.add_argument("--model", default=DEFAULT_MODEL, help="Triton model name")
    p.add_argument("--prompt", required=True, help="text_input; <image> marks where each image goes (else images come first)")
    p.add_argument("--image", action="append", default=[], metavar="FILE", help="image file (repeat for video frames)")
    p.add_argument("--lora", metavar="NAME", help="adapter name (default: the base model)")
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--temperature", type=float)
    p.add_argument("--top-p", type=float)
    p.add_argument("--seed", type=int)
    p.add_argument("--stop", action="append", metavar="TEXT", help="stop string (repeatable)")
    p.add_argument("--chat-template", action="store_true", help="wrap the prompt in the model's chat template (server side)")
    p.add_argument("--stream", action="store_true", help="print tokens as they arrive")
    p.add_argument("--json", action="store_true", help="print the result as JSON")
    p.add_argument("--timeout", type=float, default=300.0, help="seconds to wait for the answer")
    return p


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    client = VloraClient(args.url, protocol=args.protocol, model=args.model, timeout_s=args.timeout)
    options = dict(images=args.image, lora_name=args.lora, max_tokens=args.max_tokens, temperature=args.temperature,
                   top_p=args.top_p, seed=args.seed, stop=args.stop, apply_chat_template=args.chat_template)
    try:
        if args.stream and not args.json:
            finish = None
            for delta in client.generate_stream(args.prompt, **options):
                sys.stdout.write(delta.text)
                sys.stdout.flush()
                finish = delta.finish_reason or finish
            sys.stdout.write("\n")
            print(f"[finish_reason: {finish}]", file=sys.stderr)
            return 0
        result = client.generate(args.prompt, stream=args.stream, **options)
    except VloraClientError as e:
        print(f"vlora-client: server error: {e}", file=sys.stderr)
        return 1
    except OSError as e:
        print(f"vlora-client: {e}", file=sys.stderr)
        return 1
    if args.json:
        print(json.dumps(result.__dict__))
    else:
        print(result.text)
        print(f"[finish_reason: {result.finish_reason}, input tokens: {result.num_input_tokens}, "
              f"output tokens: {result.num_output_tokens}]", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
