"""The Triton model: a thin adapter between Triton's request objects and the vlora engine.

execute() validates each request and submits it to the engine, which runs on its own thread. A request
whose images have more than limits.inline_image_pixels pixels is decoded and submitted by the image
workers (a bounded pool; when its queue is full the request is refused as UNAVAILABLE), so execute()
returns at once and a heavy request delays only itself. The engine reports every event through a
callback that only enqueues; a response thread sends the responses and watches for cancelled requests.
finalize() drains the image workers and the engine, and joins the threads.

Wire format (the Triton vLLM backend's): inputs text_input, image (base64, one or more), stream,
sampling_parameters (JSON), exclude_input_in_output; lora_name in the request parameters or in
sampling_parameters. Outputs text_output, finish_reason, num_input_tokens, num_output_tokens; a request
with a ``task`` (answered by a vision task head of its adapter) also gets label, scores and label_names.

Adapter administration goes through the same model: a request whose parameters (or
sampling_parameters) carry ``adapter_action`` ("list", "load" or "unload", with ``lora_name`` for the
last two) is answered with one response whose text_output is JSON. It runs on an admin thread (a load
reads from disk there, an unload waits there for the adapter's requests to finish) and touches the
engine's state only on the engine thread. ``load`` and ``unload`` must carry ``admin_token``, the token
of the file ``lora.admin_token_file`` names (``vlora serve --admin-token-file``); without that setting
they are refused. ``list`` is open.

When the engine fails (its thread died, or the watchdog saw it stall), every request in flight is
answered with the cause, the cause is logged (``vlora: ENGINE FAILED: ...``), and this stub process
exits: Triton does not restart a dead Python stub, so ``vlora serve`` sees it go and stops the server,
which takes readiness down with it.
"""
from __future__ import annotations

import hmac
import json
import os
import queue
import threading
import time
import traceback
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Optional

import numpy as np
import triton_python_backend_utils as pb_utils

from vlora.config import EngineConfig, read_admin_token
from vlora.engine import AsyncEngine
from vlora.engine.api import (
    EngineOverloaded,
    GenerationOutput,
    GenerationRequest,
    InvalidRequest,
    SamplingParams,
    parse_sampling_json,
)
from vlora.engine.inputs import CheckedRequest

BASE_LABEL = "__base__"  # the lora_name label of requests without an adapter
CANCEL_POLL_S = 0.5  # how often in-flight requests are checked for client cancellation (one IPC each)
# Request parameters that are not sampling options; accepted and ignored (clients of the vLLM
# backend send "stream" there, and the input tensor decides).
IGNORED_PARAMETERS = ("stream",)
SAMPLING_KEYS = ("max_tokens", "temperature", "top_p", "seed", "stop", "ignore_eos") + SamplingParams.EXTRA_KEYS
ADMIN_KEY = "adapter_action"
ADMIN_ACTIONS = ("list", "load", "unload")
ADMIN_TOKEN_KEY = "admin_token"  # load/unload carry it; checked against lora.admin_token_file's token
# Tests only: a request parameter that injects a fault into the engine (accepted when the engine
# setting scheduler.fault_injection is on; see vlora.engine.async_engine.FAULTS).
FAULT_KEY = "vlora_test_fault"
ADMIN_THREADS = 4  # adapter actions at once
DEAD_FLUSH_S = 5.0  # how long a dead engine's errors may take to reach the clients before the stub exits
ENGINE_FAILED = "vlora: ENGINE FAILED"  # the log line `vlora serve` looks for


class TritonModelMetrics:
    """EngineMetrics on Triton's metrics endpoint through pb_utils.MetricFamily.

    The engine calls these from its own thread; every update is queued and applied on a metrics
    thread, so the engine never waits on the stub's IPC to the server.
    """

    BATCH_BUCKETS = [1, 2, 4, 8, 16, 32, 64, 128, 256]
    STEP_BUCKETS = [0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0]

    def __init__(self, model_name: str, version: str, instance: str = "", device: str = "") -> None:
        # One model instance per GPU: each instance's series carries its name and device (Triton names the
        # instances of one instance_group entry alike on every GPU), so the gauges of two instances do not
        # overwrite each other (sum over them for the model).
        self._labels = {"model": model_name, "version": version}
        if instance:
            self._labels["instance"] = instance
        if device:
            self._labels["device"] = device
        fam = pb_utils.MetricFamily
        # Families must stay referenced: Triton drops a family's metrics when it is collected.
        self._families = {
            "requests": fam("vlora_requests_total", "Requests admitted by the engine, per adapter", fam.COUNTER),
            "finished": fam("vlora_requests_finished_total", "Requests finished, per adapter and finish reason", fam.COUNTER),
            "output_tokens": fam("vlora_output_tokens_total", "Generated tokens, per adapter", fam.COUNTER),
            "steps": fam("vlora_engine_steps_total", "Engine iterations (one packed decoder forward each)", fam.COUNTER),
            "prefill": fam("vlora_prefill_tokens_total", "Prompt tokens processed in engine steps", fam.COUNTER),
            "decode": fam("vlora_decode_tokens_total", "Decode tokens processed in engine steps", fam.COUNTER),
            "batch_last": fam("vlora_batch_size", "Requests in the most recent engine step", fam.GAUGE),
            "batch_hist": fam("vlora_batch_size_per_step", "Requests per engine step", fam.HISTOGRAM),
            "step_hist": fam("vlora_step_duration_seconds", "Duration of one engine step", fam.HISTOGRAM),
            "running": fam("vlora_running_requests", "Requests in the running batch", fam.GAUGE),
            "waiting": fam("vlora_waiting_requests", "Requests admitted and waiting for the running batch", fam.GAUGE),
            "mode_seconds": fam("vlora_mode_seconds_total", "Engine step time spent in each inference mode", fam.COUNTER),
            "mode_steps": fam("vlora_mode_steps_total", "Engine steps run in each inference mode", fam.COUNTER),
            "mode_active": fam("vlora_mode_active", "1 for the inference mode of the latest step, 0 for the others", fam.GAUGE),
            "switches": fam("vlora_mode_switches_total", "Merges, unmerges and adapter swaps of the base weights", fam.COUNTER),
            "switch_hist": fam("vlora_mode_switch_seconds", "Duration of one mode switch", fam.HISTOGRAM),
            "adapter_running": fam("vlora_adapter_running_requests", "Requests in the running batch, per adapter", fam.GAUGE),
            "adapter_waiting": fam("vlora_adapter_waiting_requests", "Requests waiting in the engine, per adapter", fam.GAUGE),
            "gpu_load": fam("vlora_adapter_gpu_loads_total", "Adapter copies into a device slot (swap-ins), per adapter", fam.COUNTER),
            "gpu_eviction": fam("vlora_adapter_gpu_evictions_total", "Adapters leaving a device slot (replaced or unloaded), per adapter", fam.COUNTER),
            "host_load": fam("vlora_adapter_host_loads_total", "Adapter reads into host memory, per adapter", fam.COUNTER),
            "host_eviction": fam("vlora_adapter_host_evictions_total", "Adapters leaving host memory (LRU or unloaded), per adapter", fam.COUNTER),
            "resident": fam("vlora_adapters_resident", "Adapters resident per tier (gpu: device slots, cpu: host memory)", fam.GAUGE),
            "prefix_prompt": fam("vlora_prefix_cache_prompt_tokens_total", "Prompt tokens of admitted requests", fam.COUNTER),
            "prefix_reused": fam("vlora_prefix_cache_reused_tokens_total", "Prompt tokens whose KV came from the prefix cache", fam.COUNTER),
            "prefix_evictions": fam("vlora_prefix_cache_evictions_total", "Cached KV blocks evicted for new ones", fam.COUNTER),
            "encoder_hits": fam("vlora_encoder_cache_hits_total", "Images whose features came from the encoder cache", fam.COUNTER),
            "encoder_misses": fam("vlora_encoder_cache_misses_total", "Images encoded (not in the encoder cache)", fam.COUNTER),
            "encoder_evictions": fam("vlora_encoder_cache_evictions_total", "Features evicted from the encoder cache", fam.COUNTER),
            "encoder_bytes": fam("vlora_encoder_cache_bytes", "Bytes of features in the encoder cache", fam.GAUGE),
        }
        f = self._families
        self._steps = f["steps"].Metric(labels=self._labels)
        self._prefill = f["prefill"].Metric(labels=self._labels)
        self._decode = f["decode"].Metric(labels=self._labels)
        self._batch_last = f["batch_last"].Metric(labels=self._labels)
        self._batch_hist = f["batch_hist"].Metric(labels=self._labels, buckets=self.BATCH_BUCKETS)
        self._step_hist = f["step_hist"].Metric(labels=self._labels, buckets=self.STEP_BUCKETS)
        self._running = f["running"].Metric(labels=self._labels)
        self._waiting = f["waiting"].Metric(labels=self._labels)
        self._switches = f["switches"].Metric(labels=self._labels)
        self._switch_hist = f["switch_hist"].Metric(labels=self._labels, buckets=self.STEP_BUCKETS)
        self._modes = {m: (f["mode_seconds"].Metric(labels={**self._labels, "mode": m}),
                           f["mode_steps"].Metric(labels={**self._labels, "mode": m}),
                           f["mode_active"].Metric(labels={**self._labels, "mode": m}))
                       for m in ("merge", "unmerge", "mixture")}
        self._tiers = {t: f["resident"].Metric(labels={**self._labels, "tier": t}) for t in ("gpu", "cpu")}
        self._prefix = {k: f[k].Metric(labels=self._labels) for k in ("prefix_prompt", "prefix_reused", "prefix_evictions")}
        self._encoder = {k: f[k].Metric(labels=self._labels)
                         for k in ("encoder_hits", "encoder_misses", "encoder_evictions", "encoder_bytes")}
        self._last_mode: Optional[str] = None
        self._adapter_gauges: dict[str, tuple[int, int]] = {}  # lora_name -> (running, waiting) last set
        self._per_label: dict[tuple[str, ...], Any] = {}  # touched only by the metrics thread
        self._queue: "queue.Queue[Optional[tuple]]" = queue.Queue()
        self._thread = threading.Thread(target=self._loop, name="vlora-metrics", daemon=True)
        self._thread.start()

    # EngineMetrics, called on the engine thread.
    def request_admitted(self, lora_name: Optional[str]) -> None:
        self._queue.put(("requests", (lora_name or BASE_LABEL,), 1))

    def request_finished(self, lora_name: Optional[str], finish_reason: str, num_output_tokens: int) -> None:
        name = lora_name or BASE_LABEL
        self._queue.put(("finished", (name, finish_reason or "unknown"), 1))
        if num_output_tokens:
            self._queue.put(("output_tokens", (name,), num_output_tokens))

    def step(self, batch_size: int, num_prefill_tokens: int, num_decode_tokens: int, duration_s: float) -> None:
        self._queue.put(("step", batch_size, num_prefill_tokens, num_decode_tokens, duration_s))

    def queue_depth(self, running: int, waiting: int) -> None:
        self._queue.put(("depth", running, waiting))

    def mode_step(self, mode: str, merged: Optional[str], duration_s: float) -> None:
        self._queue.put(("mode", mode, duration_s))

    def mode_switch(self, from_mode: str, to_mode: str, duration_s: float) -> None:
        self._queue.put(("switch", duration_s))

    def adapter_requests(self, running, waiting) -> None:
        self._queue.put(("adapters", dict(running), dict(waiting)))

    def adapter_swap(self, kind: str, lora_name: str) -> None:
        self._queue.put((kind, (lora_name,), 1))

    def adapters_resident(self, gpu: int, host: int) -> None:
        self._queue.put(("resident", gpu, host))

    def prefix_cache(self, prompt_tokens: int, reused_tokens: int, evictions: int) -> None:
        self._queue.put(("prefix", prompt_tokens, reused_tokens, evictions))

    def encoder_cache(self, hits: int, misses: int, evictions: int, bytes_used: int) -> None:
        self._queue.put(("encoder", hits, misses, evictions, bytes_used))

    def close(self) -> None:
        self._queue.put(None)
        self._thread.join(timeout=10)

    def _labelled(self, family: str, values: tuple[str, ...]):
        key = (family,) + values
        metric = self._per_label.get(key)
        if metric is None:
            names = ("lora_name",) if family != "finished" else ("lora_name", "finish_reason")
            metric = self._families[family].Metric(labels={**self._labels, **dict(zip(names, values))})
            self._per_label[key] = metric
        return metric

    def _set_adapter_gauges(self, running: dict, waiting: dict) -> None:
        """Per-adapter gauges; an adapter that had requests and has none now goes back to 0."""
        now = {(k or BASE_LABEL): (running.get(k, 0), waiting.get(k, 0)) for k in set(running) | set(waiting)}
        for name in set(now) | set(self._adapter_gauges):
            value = now.get(name, (0, 0))
            if self._adapter_gauges.get(name) != value:
                self._labelled("adapter_running", (name,)).set(value[0])
                self._labelled("adapter_waiting", (name,)).set(value[1])
        self._adapter_gauges = {k: v for k, v in now.items()}

    def _loop(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            try:
                kind = item[0]
                if kind == "step":
                    _, bs, prefill, decode, duration = item
                    self._steps.increment(1)
                    if prefill:
                        self._prefill.increment(prefill)
                    if decode:
                        self._decode.increment(decode)
                    self._batch_last.set(bs)
                    self._batch_hist.observe(bs)
                    self._step_hist.observe(duration)
                elif kind == "depth":
                    self._running.set(item[1])
                    self._waiting.set(item[2])
                elif kind == "mode":
                    _, mode, duration = item
                    seconds, steps, active = self._modes[mode]
                    seconds.increment(duration)
                    steps.increment(1)
                    if mode != self._last_mode:
                        for m, (_, _, gauge) in self._modes.items():
                            gauge.set(1 if m == mode else 0)
                        self._last_mode = mode
                elif kind == "switch":
                    self._switches.increment(1)
                    self._switch_hist.observe(item[1])
                elif kind == "adapters":
                    self._set_adapter_gauges(item[1], item[2])
                elif kind == "prefix":
                    for key, value in zip(("prefix_prompt", "prefix_reused", "prefix_evictions"), item[1:]):
                        if value:
                            self._prefix[key].increment(value)
                elif kind == "encoder":
                    for key, value in zip(("encoder_hits", "encoder_misses", "encoder_evictions"), item[1:4]):
                        if value:
                            self._encoder[key].increment(value)
                    self._encoder["encoder_bytes"].set(item[4])
                elif kind == "resident":
                    self._tiers["gpu"].set(item[1])
                    self._tiers["cpu"].set(item[2])
                else:
                    self._labelled(kind, item[1]).increment(item[2])
            except Exception:  # a metric must never take the server down
                pb_utils.Logger.log_warn(f"vlora: metrics update failed: {traceback.format_exc()}")


@dataclass
class _InFlight:
    """What the response thread needs to answer one request."""

    request_id: str
    sender: Any
    stream: bool
    prefix: str  # prepended to a non-streaming answer when exclude_input_in_output is false
    sent_output_tokens: int = 0
    cancel_requested: bool = False


class TritonPythonModel:
    def initialize(self, args: dict[str, str]) -> None:
        self._model_config = json.loads(args["model_config"])
        if not pb_utils.using_decoupled_model_transaction_policy(self._model_config):
            raise pb_utils.TritonModelException(
                "vlora: config.pbtxt must set model_transaction_policy { decoupled: true }"
            )
        config = self._engine_config(args)
        # Read once, before the engine loads: an unreadable token file fails the model load, naming the file.
        token_file = config.lora.admin_token_file
        self._admin_token: Optional[bytes] = read_admin_token(token_file).encode("utf-8") if token_file else None
        pb_utils.Logger.log_info(
            f"vlora: loading the engine (model {config.model.path or 'tiny default'}, device {config.model.device}, "
            f"dtype {config.model.dtype})"
        )
        pb_utils.Logger.log_verbose(f"vlora: engine config {json.dumps(config.to_dict(), default=str)}")
        gpu = args.get("model_instance_kind") == "GPU"
        self._metrics = TritonModelMetrics(args["model_name"], args["model_version"], args.get("model_instance_name", ""),
                                           f"cuda:{int(args['model_instance_device_id'])}" if gpu else "cpu")
        self._responses: "queue.Queue[Any]" = queue.Queue()
        self._engine = AsyncEngine(config, metrics=self._metrics, on_dead=self._engine_failed)
        pb_utils.Logger.log_info(
            f"vlora: model {self._engine.model_info}; adapters {self._engine.list_adapters()}"
        )
        self._response_thread = threading.Thread(target=self._response_loop, name="vlora-responses", daemon=True)
        self._response_thread.start()
        # Several: an unload may wait (lora.unload_timeout_s) for its adapter's requests, and a list must not.
        self._admin = ThreadPoolExecutor(max_workers=ADMIN_THREADS, thread_name_prefix="vlora-admin")

    @staticmethod
    def _engine_config(args: dict[str, str]) -> EngineConfig:
        """Defaults, then `config_file` (YAML), then flat `section.field` parameters; Triton places the device."""
        params = {
            key: value.get("string_value", "")
            for key, value in json.loads(args["model_config"]).get("parameters", {}).items()
        }
        config_file = params.pop("config_file", "")
        config = EngineConfig.from_yaml(config_file) if config_file else EngineConfig()
        config = config.with_overrides(params)
        if args.get("model_instance_kind") == "GPU":
            device = f"cuda:{int(args['model_instance_device_id'])}"
            if config.model.device not in ("auto", device):
                pb_utils.Logger.log_warn(
                    f"vlora: model.device={config.model.device} ignored; Triton placed this instance on {device}"
                )
            config = config.with_overrides({"model.device": device})
        return config

    def execute(self, requests):
        for request in requests:
            self._admit(request)
        return None

    def _admit(self, request) -> None:
        sender = request.get_response_sender()
        request_id = uuid.uuid4().hex
        try:
            admin = _admin_request(request)
            if admin is not None:
                self._admin.submit(self._run_admin, sender, *admin)
                return
            gen, exclude_input, fault = self._parse(request, request_id)
            checked = self._engine.check(gen)  # fields, adapter, image headers: no pixel decoded yet
            if checked.pixels > self._engine.config.limits.inline_image_pixels:
                # Decoding costs CPU per pixel: on the image workers, so that execute() returns at once
                # and this request delays only itself.
                self._engine.defer(lambda: self._enter_deferred(sender, checked, exclude_input, fault),
                                   lambda reason: self._send_error(sender, reason, unavailable=True))
                return
        except InvalidRequest as e:
            self._send_error(sender, str(e))
            return
        except EngineOverloaded as e:  # the image workers' queue is full, or the server is stopping
            self._send_error(sender, str(e) or "server overloaded", unavailable=True)
            return
        except Exception as e:
            pb_utils.Logger.log_error(f"vlora: request refused by an internal error: {traceback.format_exc()}")
            self._send_error(sender, f"internal error: {type(e).__name__}: {e}")
            return
        self._enter(sender, checked, exclude_input, fault)

    def _enter_deferred(self, sender, checked: CheckedRequest, exclude_input: bool, fault: Optional[str]) -> None:
        """An image worker: ``_enter`` unless the client went away while the request waited."""
        try:
            cancelled = sender.is_cancelled()
        except Exception:
            cancelled = False
        if cancelled:
            self._send_cancelled(sender)
            return
        self._enter(sender, checked, exclude_input, fault)

    def _enter(self, sender, checked: CheckedRequest, exclude_input: bool, fault: Optional[str]) -> None:
        """Preprocess (decode the images, build the model inputs) and submit one checked request; every
        refusal goes to its client."""
        gen = checked.req
        request_id = gen.request_id
        try:
            prepared = self._engine.preprocess(checked)
        except InvalidRequest as e:
            self._send_error(sender, str(e))
            return
        except Exception as e:
            pb_utils.Logger.log_error(f"vlora: request refused by an internal error: {traceback.format_exc()}")
            self._send_error(sender, f"internal error: {type(e).__name__}: {e}")
            return
        state = _InFlight(
            request_id=request_id,
            sender=sender,
            stream=gen.stream,
            prefix="" if exclude_input or gen.stream else gen.prompt,
        )
        # Registered before submit: the queue is FIFO, so the response thread knows the request
        # before its first output arrives.
        self._responses.put(("open", state))
        try:
            # Blocks while the engine is full: that is what pushes back into Triton's queue (or, on an
            # image worker, into the image workers' bounded queue).
            self._engine.submit(prepared, self._responses.put, fault=fault)
        except EngineOverloaded as e:
            self._responses.put(("close", request_id))
            self._send_error(sender, str(e) or "server overloaded", unavailable=True)
        except InvalidRequest as e:
            self._responses.put(("close", request_id))
            self._send_error(sender, str(e))
        except Exception as e:
            self._responses.put(("close", request_id))
            pb_utils.Logger.log_error(f"vlora: submit failed: {traceback.format_exc()}")
            self._send_error(sender, f"internal error: {type(e).__name__}: {e}")

    def _parse(self, request, request_id: str) -> tuple[GenerationRequest, bool, Optional[str]]:
        """Triton tensors and parameters -> GenerationRequest. Raises InvalidRequest naming the problem."""
        text = _single(request, "text_input")
        if text is None:
            raise InvalidRequest("text_input is required")
        try:
            prompt = text.decode("utf-8") if isinstance(text, bytes) else str(text)
        except UnicodeDecodeError:
            raise InvalidRequest("text_input is not valid UTF-8") from None

        # Base64 as sent (the vLLM backend's convention); engine.prepare decodes and checks them.
        tensor = pb_utils.get_input_tensor_by_name(request, "image")
        images = [bytes(item) for item in tensor.as_numpy().reshape(-1)] if tensor is not None else []

        stream = bool(_single(request, "stream") or False)
        exclude = _single(request, "exclude_input_in_output")
        exclude_input = True if exclude is None else bool(exclude)

        # Request parameters first, then the sampling_parameters input over them.
        options = _request_parameters(request)
        options.update(parse_sampling_json(_single(request, "sampling_parameters")))
        fault = options.pop(FAULT_KEY, None)
        if fault is not None and not self._engine.config.scheduler.fault_injection:
            raise InvalidRequest(f"unknown request parameter(s) {[FAULT_KEY]}; accepted: {sorted(SAMPLING_KEYS + (ADMIN_KEY,))}")
        extras = {k: options.pop(k) for k in SamplingParams.EXTRA_KEYS if k in options}
        sampling = SamplingParams.from_dict(options)
        lora_name = extras.get("lora_name")
        if lora_name is not None and not isinstance(lora_name, str):
            raise InvalidRequest(f"lora_name must be a string, got {lora_name!r}")
        apply_chat_template = extras.get("apply_chat_template", False)
        if not isinstance(apply_chat_template, bool):
            raise InvalidRequest("apply_chat_template must be true or false")
        task = extras.get("task")
        if task is not None and not isinstance(task, str):
            raise InvalidRequest("task must be a string")
        return (
            GenerationRequest(
                request_id=request_id,
                prompt=prompt,
                images=images,
                lora_name=lora_name or None,
                sampling=sampling,
                stream=stream,
                apply_chat_template=apply_chat_template,
                task=task,
            ),
            exclude_input,
            fault,
        )

    def _check_admin_token(self, action: str, token: Any) -> None:
        """load/unload need the configured token; raises InvalidRequest saying why (never echoing a token)."""
        if action == "list":
            return
        if self._admin_token is None:
            raise InvalidRequest(
                f"{ADMIN_KEY} {action!r} is off on this server: start it with `vlora serve --admin-token-file FILE` "
                f"(engine setting lora.admin_token_file) and send that file's token as {ADMIN_TOKEN_KEY}")
        if not isinstance(token, str) or not hmac.compare_digest(token.encode("utf-8"), self._admin_token):
            what = "missing" if token is None else "wrong"
            raise InvalidRequest(f"{ADMIN_KEY} {action!r} refused: {what} {ADMIN_TOKEN_KEY} "
                                 f"(send the token of the server's --admin-token-file)")

    def _run_admin(self, sender, action: str, name: Optional[str], token: Any = None) -> None:
        """The admin thread: one adapter action, answered with JSON in text_output."""
        try:
            self._check_admin_token(action, token)
        except InvalidRequest as e:  # one line per refused request, no traceback, no token
            pb_utils.Logger.log_warn(f"vlora: {e}")
            self._send_error(sender, str(e))
            return
        try:
            if action == "list":
                payload = {"adapters": self._engine.adapters()}
            elif action == "load":
                payload = {"loaded": self._engine.load_adapter(name)}
            else:
                payload = {"unloaded": self._engine.unload_adapter(name)}
        except InvalidRequest as e:  # unknown, malformed or busy adapter: the reason goes to the client
            self._send_error(sender, str(e))
            return
        except EngineOverloaded as e:
            self._send_error(sender, str(e), unavailable=True)
            return
        except Exception as e:
            pb_utils.Logger.log_error(f"vlora: adapter_action {action} failed: {traceback.format_exc()}")
            self._send_error(sender, f"internal error: {type(e).__name__}: {e}")
            return
        if action == "load":
            pb_utils.Logger.log_info(f"vlora: adapter {name} loaded")
        elif action == "unload":  # "unloading" when its running requests outlasted lora.unload_timeout_s
            state = payload["unloaded"].get("state", "unloaded") if isinstance(payload["unloaded"], dict) else "unloaded"
            pb_utils.Logger.log_info(f"vlora: adapter {name} {state}")
        tensors = [
            _string_tensor("text_output", json.dumps(payload)),
            _string_tensor("finish_reason", "stop"),
            pb_utils.Tensor("num_input_tokens", np.array([0], dtype=np.uint32)),
            pb_utils.Tensor("num_output_tokens", np.array([0], dtype=np.uint32)),
        ]
        try:
            sender.send(pb_utils.InferenceResponse(output_tensors=tensors), flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
        except Exception:
            pb_utils.Logger.log_error(f"vlora: sending an adapter_action answer failed: {traceback.format_exc()}")

    def _response_loop(self) -> None:
        """Send what the engine produced; cancel requests whose clients went away."""
        inflight: dict[str, _InFlight] = {}
        last_poll = time.monotonic()
        while True:
            try:
                item = self._responses.get(timeout=CANCEL_POLL_S)
            except queue.Empty:
                item = None
            if item is _STOP:
                break
            if isinstance(item, GenerationOutput):
                state = inflight.get(item.request_id)
                if state is not None:
                    self._send_output(state, item)
                    if item.finished:
                        del inflight[item.request_id]
            elif isinstance(item, tuple):
                if item[0] == "flushed":  # everything queued before it has been sent
                    item[1].set()
                elif item[0] == "open":
                    inflight[item[1].request_id] = item[1]
                elif item[0] == "close":
                    inflight.pop(item[1], None)
            now = time.monotonic()
            if inflight and now - last_poll >= CANCEL_POLL_S:
                last_poll = now
                self._poll_cancelled(inflight)
        for state in inflight.values():
            self._send_error(state.sender, "server shutting down", unavailable=True)

    def _engine_failed(self, cause: str) -> None:
        """The engine is dead and has failed its requests (their errors are queued): log the cause, let
        the response thread send them, then end this stub process (see the module docstring)."""
        pb_utils.Logger.log_error(f"{ENGINE_FAILED}: {cause}; in-flight requests were failed; "
                                  "the model instance stops now")

        def exit_when_sent() -> None:
            flushed = threading.Event()
            self._responses.put(("flushed", flushed))
            flushed.wait(DEAD_FLUSH_S)
            time.sleep(0.5)  # the last sends and the log line reach the server
            os._exit(1)

        threading.Thread(target=exit_when_sent, name="vlora-engine-failed", daemon=True).start()

    def _poll_cancelled(self, inflight: dict[str, _InFlight]) -> None:
        for state in inflight.values():
            if state.cancel_requested:
                continue
            try:
                cancelled = state.sender.is_cancelled()
            except Exception:
                cancelled = False
            if cancelled:
                state.cancel_requested = True
                self._engine.cancel(state.request_id)

    def _send_output(self, state: _InFlight, out: GenerationOutput) -> None:
        try:
            if out.finished and (out.error or out.finish_reason == "error"):
                # A dead engine's errors are "unavailable": the request was fine, the server is not.
                self._send_error(state.sender, out.error or "generation failed", unavailable=self._engine.dead is not None)
                return
            if out.finished and out.finish_reason == "cancelled" and state.cancel_requested:
                self._send_cancelled(state.sender)
                return
            if state.stream:
                if not out.finished and not out.text_delta:
                    return
                tensors = [
                    _string_tensor("text_output", out.text_delta),
                    pb_utils.Tensor("num_input_tokens", np.array([out.num_input_tokens], dtype=np.uint32)),
                    pb_utils.Tensor(
                        "num_output_tokens",
                        np.array([max(out.num_output_tokens - state.sent_output_tokens, 0)], dtype=np.uint32),
                    ),
                ]
                state.sent_output_tokens = out.num_output_tokens
            elif out.finished:
                tensors = [
                    _string_tensor("text_output", state.prefix + out.text),
                    pb_utils.Tensor("num_input_tokens", np.array([out.num_input_tokens], dtype=np.uint32)),
                    pb_utils.Tensor("num_output_tokens", np.array([out.num_output_tokens], dtype=np.uint32)),
                ]
            else:
                return
            flags = 0
            if out.finished:
                tensors.append(_string_tensor("finish_reason", out.finish_reason or "stop"))
                if "label" in out.extra:  # a task head's answer
                    tensors += _head_tensors(out.extra)
                flags = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL
            state.sender.send(pb_utils.InferenceResponse(output_tensors=tensors), flags=flags)
        except Exception:
            pb_utils.Logger.log_error(f"vlora: sending a response failed: {traceback.format_exc()}")

    @staticmethod
    def _send_error(sender, message: str, unavailable: bool = False) -> None:
        code = getattr(pb_utils.TritonError, "UNAVAILABLE" if unavailable else "INVALID_ARG", None)
        error = pb_utils.TritonError(message) if code is None else pb_utils.TritonError(message, code)
        try:
            sender.send(pb_utils.InferenceResponse(error=error), flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
        except Exception:
            pb_utils.Logger.log_error(f"vlora: sending an error failed: {traceback.format_exc()}")

    @staticmethod
    def _send_cancelled(sender) -> None:
        code = getattr(pb_utils.TritonError, "CANCELLED", None)
        error = pb_utils.TritonError("request cancelled") if code is None else pb_utils.TritonError("request cancelled", code)
        try:
            sender.send(pb_utils.InferenceResponse(error=error), flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
        except Exception:
            pb_utils.Logger.log_warn(f"vlora: sending a cancellation failed: {traceback.format_exc()}")

    def finalize(self) -> None:
        pb_utils.Logger.log_info("vlora: draining the engine")
        self._admin.shutdown(wait=False, cancel_futures=True)
        try:
            self._engine.shutdown()
        finally:
            self._responses.put(_STOP)
            self._response_thread.join(timeout=30)
            self._metrics.close()
        pb_utils.Logger.log_info("vlora: stopped")


_STOP = object()


def _single(request, name: str):
    """The first element of an optional input tensor, or None when the client did not send it."""
    tensor = pb_utils.get_input_tensor_by_name(request, name)
    if tensor is None:
        return None
    values = tensor.as_numpy().reshape(-1)
    if values.size == 0:
        return None
    value = values[0]
    return value.item() if isinstance(value, np.generic) else value


def _request_parameters(request) -> dict[str, Any]:
    """Request parameters (JSON keys of /generate that are not inputs, or gRPC parameters)."""
    raw = request.parameters()
    params = json.loads(raw) if raw else {}
    for key in IGNORED_PARAMETERS:
        params.pop(key, None)
    unknown = sorted(set(params) - set(SAMPLING_KEYS) - {ADMIN_KEY, ADMIN_TOKEN_KEY, FAULT_KEY})
    if unknown:
        raise InvalidRequest(
            f"unknown request parameter(s) {unknown}; accepted: {sorted(SAMPLING_KEYS + (ADMIN_KEY,))}"
        )
    return params


def _admin_request(request) -> Optional[tuple[str, Optional[str], Any]]:
    """(action, lora_name, admin_token) when the request is an adapter_action, else None. Raises
    InvalidRequest. The token is checked on the admin thread (TritonPythonModel._check_admin_token)."""
    options = _request_parameters(request)
    options.update(parse_sampling_json(_single(request, "sampling_parameters")))
    if ADMIN_KEY not in options:
        return None
    action = options.pop(ADMIN_KEY)
    if action not in ADMIN_ACTIONS:
        raise InvalidRequest(f"{ADMIN_KEY} must be one of {list(ADMIN_ACTIONS)}, got {action!r}")
    name = options.pop("lora_name", None)
    token = options.pop(ADMIN_TOKEN_KEY, None)
    if options:
        raise InvalidRequest(f"an {ADMIN_KEY} request takes only lora_name and {ADMIN_TOKEN_KEY}, not {sorted(options)}")
    if action == "list":
        if name is not None:
            raise InvalidRequest(f"{ADMIN_KEY} \"list\" takes no lora_name")
    elif not isinstance(name, str) or not name:
        raise InvalidRequest(f"{ADMIN_KEY} {action!r} needs lora_name, the adapter's folder name under the adapter root")
    return action, name, token


def _head_tensors(answer: dict[str, Any]) -> list:
    """``label``, ``scores`` (one per label, softmax) and ``label_names`` (in the same order)."""
    return [
        _string_tensor("label", answer["label"]),
        pb_utils.Tensor("scores", np.asarray(answer["scores"], dtype=np.float32)),
        pb_utils.Tensor("label_names", np.array([x.encode("utf-8") for x in answer["labels"]], dtype=np.object_)),
    ]


def _string_tensor(name: str, text: str):
    return pb_utils.Tensor(name, np.array([text.encode("utf-8")], dtype=np.object_))
