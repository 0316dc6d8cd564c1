"""The ``vlora`` command. Subcommands are a registry of modules, imported only when chosen.

Each module listed in ``COMMANDS`` provides ``add_arguments(parser)`` and ``run(args) -> int``.
To add a subcommand (``train``, ``fuse``, ``loadtest`` ...), write such a module and list it here.
"""
from __future__ import annotations

import argparse
import importlib
import sys
from typing import Optional, Sequence

# name -> (module, one-line help)
COMMANDS: dict[str, tuple[str, str]] = {
    "serve": ("vlora.server.launcher", "start tritonserver with the vlora model and print where to send requests"),
    "doctor": ("vlora.server.doctor", "report what this machine can run: Python, torch, CUDA, tritonserver, ATMM extension"),
    "train": ("vlora.fusion.train_cli", "train one LoRA adapter (PEFT), with or without task heads, on vision datasets"),
    "fuse": ("vlora.fusion.fuse_cli", "fuse vision datasets into the fewest adapters that keep every accuracy floor"),
    "loadtest": ("vlora_load.cli", "load a server with a workload through locust (headless) and write a report"),
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="vlora", description="Multi-LoRA multimodal serving inside NVIDIA Triton.")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True
    for name, (module, help_text) in COMMANDS.items():
        p = sub.add_parser(name, help=help_text, description=help_text)
        p.set_defaults(_module=module)
        # Arguments are added lazily (see main) so that `vlora --help` imports nothing heavy.
    return parser


def main(argv: Optional[Sequence[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    if argv and argv[0] in COMMANDS:
        name = argv[0]
        module = importlib.import_module(COMMANDS[name][0])
        sub = argparse.ArgumentParser(prog=f"vlora {name}", description=COMMANDS[name][1])
        module.add_arguments(sub)
        return int(module.run(sub.parse_args(argv[1:])) or 0)
    parser.parse_args(argv)  # prints usage or help and exits
    return 2


if __name__ == "__main__":
    sys.exit(main())
