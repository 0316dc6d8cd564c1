"""The Triton model's metrics: the engine's EngineMetrics reported as custom metric families (``vlora_*``) on
Triton's own metrics endpoint, next to Triton's ``nv_*`` ones. Every series carries the model, its version and,
with one instance per GPU, the instance and its device."""
from __future__ import annotations

import queue
import threading
import traceback
from typing import Any, Optional

BASE_LABEL = "__base__"  # the lora_name label of requests without an adapter


class TritonModelMetrics:
    """EngineMetrics on Triton's metrics endpoint through ``pb_utils.MetricFamily`` (``pb_utils``: Triton's
    triton_python_backend_utils, or a test's fake).

    The engine calls these from its own thread; every update is queued and applied on a metrics
    thread, so the engine never waits on the stub's IPC to the server.
    """

    BATCH_BUCKETS = [1, 2, 4, 8, 16, 32, 64, 128, 256]
    STEP_BUCKETS = [0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0]

    def __init__(self, pb_utils: Any, model_name: str, version: str, instance: str = "", device: str = "") -> None:
        # One model instance per GPU: each instance's series carries its name and device (Triton names the
        # instances of one instance_group entry alike on every GPU), so the gauges of two instances do not
        # overwrite each other (sum over them for the model).
        self._labels = {"model": model_name, "version": version}
        if instance:
            self._labels["instance"] = instance
        if device:
            self._labels["device"] = device
        self._log = pb_utils.Logger
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
                self._log.log_warn(f"vlora: metrics update failed: {traceback.format_exc()}")
