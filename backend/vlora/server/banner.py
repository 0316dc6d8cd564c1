"""The banner ``vlora serve`` prints once tritonserver (and the OpenAI front end) are ready: the model, the adapters
found in the adapter root, the adapter and Triton admin settings, where to send requests, and an example."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

from vlora.config import EngineConfig, default_cache_dir
from vlora.server.lockdown import ADMIN_KEY_HEADER, GRPC_ADMIN_KEY_HEADER
from vlora.server.options import ServeOptions
from vlora.server.repository import MODEL_NAME


def list_adapter_names(adapter_root: Optional[str]) -> list[str]:
    if not adapter_root or not Path(adapter_root).is_dir():
        return []
    return sorted(p.name for p in Path(adapter_root).iterdir() if (p / "adapter_config.json").is_file())


def serving_banner(options: ServeOptions, engine_config: EngineConfig, model_dir: Optional[str],
                   adapter_root: Optional[str], http_url: str, grpc_url: str, metrics_url: str,
                   openai_url: Optional[str], log_path: Optional[Path]) -> str:
    """What `vlora serve` prints once it serves: the model, the adapters, the admin settings, where to send
    requests (TritonServer's URLs) and an example."""
    adapters = list_adapter_names(adapter_root)
    model = model_dir or "the embedded tiny model"
    if engine_config.model.path is None:
        model += " (the embedded tiny RANDOM model: its answers are meaningless text)"
    example_lora = adapters[0] if adapters else None
    body = {"text_input": "Describe the image.", "sampling_parameters": json.dumps({"max_tokens": 16})}
    if example_lora:
        body["lora_name"] = example_lora
    lines = [
        "",
        f"vlora is serving model '{MODEL_NAME}': {model}",
        f"  adapters: {', '.join(adapters) if adapters else '(none found)'}",
        f"  adapter root: {_adapter_root_description(adapter_root, engine_config)}",
        f"  adapter admin: {_admin_description(engine_config)}",
        f"  Triton admin APIs: {_triton_admin_description(engine_config)}",
        f"  listening on {options.listen_description}",
        f"  HTTP     {http_url}/v2/models/{MODEL_NAME}/generate   (streaming: .../generate_stream)",
        f"  gRPC     {grpc_url}   (tritonclient streaming RPC, model '{MODEL_NAME}')",
        f"  metrics  {metrics_url}",
        *([f"  OpenAI   {openai_url}   (chat/completions, completions, models; model '{MODEL_NAME}' or an adapter's name)"]
          if openai_url else []),
        f"  log      {log_path}",
        "  try:",
        f"    curl -s -X POST {http_url}/v2/models/{MODEL_NAME}/generate -d '{json.dumps(body)}'",
        f"    vlora-client --url {grpc_url} --prompt 'Describe the image.'"
        + (f" --lora {example_lora}" if example_lora else "") + " --stream",
        "Press Ctrl-C to stop (in-flight requests are drained first).",
        "",
    ]
    return "\n".join(lines)


def _adapter_root_description(adapter_root: Optional[str], engine_config: EngineConfig) -> str:
    if adapter_root:
        return (f"{adapter_root} (one PEFT folder per adapter, served by its folder name; "
                "a folder added later: `vlora-client adapters load NAME`)")
    if engine_config.model.path is not None:
        return "none (--adapters DIR serves the PEFT folders under DIR)"
    cache_dir = Path(engine_config.model.cache_dir) if engine_config.model.cache_dir else default_cache_dir()
    return f"{cache_dir / 'demo-adapters'} (the demo adapters, generated at model load)"


def _admin_description(engine_config: EngineConfig) -> str:
    token_file = engine_config.lora.admin_token_file
    if token_file:
        return f"load/unload need the token in {token_file} (admin_token); list is open"
    return "load/unload are off (enable them with --admin-token-file FILE); list is open"


def _triton_admin_description(engine_config: EngineConfig) -> str:
    apis = "shared-memory, logging, trace, model-repository"
    if engine_config.lora.admin_token_file:
        return (f"{apis} need the header '{ADMIN_KEY_HEADER}: <key>' (gRPC: '{GRPC_ADMIN_KEY_HEADER}'), "
                "the key being sha256('vlora-triton-admin-key:' + token) in hex")
    return f"{apis} are off (they need an admin token: --admin-token-file FILE)"
