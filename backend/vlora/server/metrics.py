"""The Triton model's metrics: the engine's EngineMetrics reported as custom metric families (``vlora_*``) on
Triton's own metrics endpoint, next to Triton's ``nv_*`` ones. Every series carries the model, its version and,
with one instance per GPU, the instance and its device.

Every ``Metric.increment``/``set``/``observe`` of the Python backend is an IPC round trip from the stub
process to the server, and ``set`` holds the GIL through it. Made per engine step, those calls (and the
thread hand-offs they cost) slowed the engine thread inside the stub. So the engine's reports only
accumulate plain Python values (counter increments, the latest gauge values, the histograms'
observations), and one metrics thread applies them every ``FLUSH_INTERVAL_S`` (0.2 s): one
increment per counter that moved, one set per gauge that changed, and one observe per histogram
observation (Triton's histograms take no bucket counts). A scrape therefore lags the engine by at most
the flush interval (plus the time of one flush); close() applies what is left before it returns.

The Gateway API Inference Extension's model server protocol (its endpoint picker routes on these; the mapping
is in deploy/kubernetes/README.md): running requests ``vlora_running_requests``; queued requests
``vlora_waiting_requests`` plus Triton's queue (the OpenAI front end's ``/metrics`` adds their sum,
``vlora_queued_requests``: vlora.server.openai.metrics); KV-cache utilization ``vlora_kv_cache_usage_ratio``
(0 to 1); and the LoRA info gauge ``vlora_lora_requests_info`` (labels ``running_lora_adapters``,
``waiting_lora_adapters``: comma-separated adapter names, ``max_lora``: the device slots; value: the Unix time
its label set last became current, so the newest set has the largest value, as vLLM's
``vllm:lora_requests_info``).
"""
from __future__ import annotations

import threading
import time
import traceback
from typing import Any, Optional

from vlora.metrics import EXPORTED_STAGES

BASE_LABEL = "__base__"  # the lora_name label of requests without an adapter
FLUSH_INTERVAL_S = 0.2  # how often the metrics thread applies the engine's reports to Triton's metrics
LORA_INFO = ("vlora_lora_requests_info", "Adapters with running and waiting requests (comma-separated) and the "
             "device slots (max_lora); value: the Unix time this label set last became current")
LORA_INFO_SERIES = 64  # label sets the LoRA info gauge keeps before it starts a fresh family (see _set_lora_info)


class TritonModelMetrics:
    """EngineMetrics on Triton's metrics endpoint through ``pb_utils.MetricFamily`` (``pb_utils``: Triton's
    triton_python_backend_utils, or a test's fake).

    The engine calls these from its own thread; they only accumulate, under one short lock, and the
    metrics thread applies them every ``flush_interval_s`` (see the module docstring), so the engine
    never waits on the stub's IPC to the server nor wakes another thread per step.
    """

    BATCH_BUCKETS = [1, 2, 4, 8, 16, 32, 64, 128, 256]
    STEP_BUCKETS = [0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0]

    def __init__(self, pb_utils: Any, model_name: str, version: str, instance: str = "", device: str = "",
                 flush_interval_s: float = FLUSH_INTERVAL_S, max_lora: int = 0,
                 lora_info_series: int = LORA_INFO_SERIES) -> None:
        """``max_lora``: the adapters' device slots (lora.max_gpu_adapters), the LoRA info gauge's ``max_lora``
        label; 0: no LoRA info gauge."""
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
            "kv_usage": fam("vlora_kv_cache_usage_ratio", "Fraction of the KV cache's blocks held by requests (0 to 1)", fam.GAUGE),
            "prefix_prompt": fam("vlora_prefix_cache_prompt_tokens_total", "Prompt tokens of admitted requests", fam.COUNTER),
            "prefix_reused": fam("vlora_prefix_cache_reused_tokens_total", "Prompt tokens whose KV came from the prefix cache", fam.COUNTER),
            "prefix_evictions": fam("vlora_prefix_cache_evictions_total", "Cached KV blocks evicted for new ones", fam.COUNTER),
            "encoder_hits": fam("vlora_encoder_cache_hits_total", "Images whose features came from the encoder cache", fam.COUNTER),
            "encoder_misses": fam("vlora_encoder_cache_misses_total", "Images encoded (not in the encoder cache)", fam.COUNTER),
            "encoder_evictions": fam("vlora_encoder_cache_evictions_total", "Features evicted from the encoder cache", fam.COUNTER),
            "encoder_bytes": fam("vlora_encoder_cache_bytes", "Bytes of features in the encoder cache", fam.GAUGE),
            "stage": fam("vlora_stage_seconds", "Time per request stage, by the engine's own timers (admit, queue, image_decode, "
                         "preprocess, vision, prefill_step, decode_step; per adapter brought in: adapter_read, "
                         "adapter_copy, adapter_copy_queue, adapter_copy_work, adapter_copy_host, "
                         "adapter_copy_wait, adapter_copy_h2d)", fam.HISTOGRAM),
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
        self._kv_usage = f["kv_usage"].Metric(labels=self._labels)
        self._prefix = {k: f[k].Metric(labels=self._labels) for k in ("prefix_prompt", "prefix_reused", "prefix_evictions")}
        self._encoder = {k: f[k].Metric(labels=self._labels)
                         for k in ("encoder_hits", "encoder_misses", "encoder_evictions", "encoder_bytes")}
        # The counters without per-request labels, by the first element of their accumulation key.
        self._fixed = {"steps": self._steps, "prefill": self._prefill, "decode": self._decode, "switches": self._switches,
                       **self._prefix, **{k: v for k, v in self._encoder.items() if k != "encoder_bytes"}}
        self._histograms = {"batch_hist": self._batch_hist, "step_hist": self._step_hist, "switch_hist": self._switch_hist,
                            **{f"stage:{s}": f["stage"].Metric(labels={**self._labels, "stage": s}, buckets=self.STEP_BUCKETS)
                               for s in EXPORTED_STAGES}}
        # Engine-side accumulation: plain Python values under one short lock, taken by flush().
        self._lock = threading.Lock()
        self._counts: dict[tuple, float] = {}  # counter key (family, label values...) -> increment since the last flush
        self._gauges: dict[str, Any] = {}  # gauge -> latest value reported since the last flush
        self._observed: dict[str, list[float]] = {name: [] for name in self._histograms}
        # What the flushing thread last applied (touched only under _flush_lock).
        self._flush_lock = threading.Lock()
        self._applied: dict[str, Any] = {}  # gauge -> value last set on Triton
        self._adapter_gauges: dict[str, tuple[int, int]] = {}  # lora_name -> (running, waiting) last set
        self._per_label: dict[tuple[str, ...], Any] = {}
        self.flushes = 0  # flushes that applied something (for tests and benchmarks)
        self.ipc_calls = 0  # Metric.increment/set/observe calls made on Triton (for tests and benchmarks)
        # The LoRA info gauge: its family, its series by (running, waiting) label values, the label set now
        # current and the last value set (strictly increasing). Made in __init__, changed by the flushing thread.
        self._pb_family = fam
        self._max_lora = max_lora
        self._lora_info_cap = max(1, lora_info_series)
        self._lora_info_family = None
        self._lora_info_series: dict[tuple[str, str], Any] = {}
        self._lora_info_current: Optional[tuple[str, str]] = None
        self._lora_info_stamp = 0.0
        if max_lora > 0:
            self._lora_info_family = fam(*LORA_INFO, fam.GAUGE)
            self._set_lora_info({}, {})  # the gauge exists from the start: nothing running or waiting
        self._interval = flush_interval_s
        self._stop = threading.Event()
        self._closed = False
        self._thread = threading.Thread(target=self._loop, name="vlora-metrics", daemon=True)
        self._thread.start()

    # EngineMetrics, called on the engine thread (adapter_swap also on loader threads): plain Python only.
    def _count(self, key: tuple, value: float) -> None:
        with self._lock:
            self._counts[key] = self._counts.get(key, 0) + value

    def request_admitted(self, lora_name: Optional[str]) -> None:
        self._count(("requests", lora_name or BASE_LABEL), 1)

    def request_finished(self, lora_name: Optional[str], finish_reason: str, num_output_tokens: int) -> None:
        name = lora_name or BASE_LABEL
        key = ("finished", name, finish_reason or "unknown")
        with self._lock:
            c = self._counts
            c[key] = c.get(key, 0) + 1
            if num_output_tokens:
                key = ("output_tokens", name)
                c[key] = c.get(key, 0) + num_output_tokens

    def step(self, batch_size: int, num_prefill_tokens: int, num_decode_tokens: int, duration_s: float) -> None:
        with self._lock:
            c = self._counts
            c[("steps",)] = c.get(("steps",), 0) + 1
            if num_prefill_tokens:
                c[("prefill",)] = c.get(("prefill",), 0) + num_prefill_tokens
            if num_decode_tokens:
                c[("decode",)] = c.get(("decode",), 0) + num_decode_tokens
            self._gauges["batch_last"] = batch_size
            self._observed["batch_hist"].append(batch_size)
            self._observed["step_hist"].append(duration_s)

    def stage(self, name: str, seconds: float) -> None:
        with self._lock:
            values = self._observed.get(f"stage:{name}")
            if values is not None:
                values.append(seconds)

    def queue_depth(self, running: int, waiting: int) -> None:
        with self._lock:
            self._gauges["depth"] = (running, waiting)

    def mode_step(self, mode: str, merged: Optional[str], duration_s: float) -> None:
        with self._lock:
            c = self._counts
            key = ("mode_seconds", mode)
            c[key] = c.get(key, 0) + duration_s
            key = ("mode_steps", mode)
            c[key] = c.get(key, 0) + 1
            self._gauges["mode"] = mode

    def mode_switch(self, from_mode: str, to_mode: str, duration_s: float) -> None:
        with self._lock:
            self._counts[("switches",)] = self._counts.get(("switches",), 0) + 1
            self._observed["switch_hist"].append(duration_s)

    def adapter_requests(self, running, waiting) -> None:
        with self._lock:
            # The latest counts, and every adapter named since the last flush: one that came and went
            # between two flushes still shows 0, as when every report was applied.
            last = self._gauges.get("adapters")
            seen = last[2] if last else set()
            seen.update(k or BASE_LABEL for k in running)
            seen.update(k or BASE_LABEL for k in waiting)
            self._gauges["adapters"] = (dict(running), dict(waiting), seen)

    def adapter_swap(self, kind: str, lora_name: str) -> None:
        self._count((kind, lora_name), 1)

    def adapters_resident(self, gpu: int, host: int) -> None:
        with self._lock:
            self._gauges["resident"] = (gpu, host)

    def kv_cache_usage(self, used_blocks: int, total_blocks: int) -> None:
        with self._lock:
            self._gauges["kv_usage"] = used_blocks / total_blocks if total_blocks > 0 else 0.0

    def prefix_cache(self, prompt_tokens: int, reused_tokens: int, evictions: int) -> None:
        with self._lock:
            self._add_counts(prefix_prompt=prompt_tokens, prefix_reused=reused_tokens, prefix_evictions=evictions)

    def encoder_cache(self, hits: int, misses: int, evictions: int, bytes_used: int) -> None:
        with self._lock:
            self._add_counts(encoder_hits=hits, encoder_misses=misses, encoder_evictions=evictions)
            self._gauges["encoder_bytes"] = bytes_used

    def _add_counts(self, **values: int) -> None:
        """Add each nonzero value to its unlabelled counter (the caller holds the lock)."""
        c = self._counts
        for name, value in values.items():
            if value:
                c[(name,)] = c.get((name,), 0) + value

    # Flushing, on the metrics thread (and in flush() and close()).
    def flush(self) -> None:
        """Apply everything reported so far to Triton's metrics now. The metrics thread does this every
        ``flush_interval_s``; close() does it a last time."""
        with self._flush_lock:
            with self._lock:
                counts, self._counts = self._counts, {}
                gauges, self._gauges = self._gauges, {}
                observed = self._observed
                self._observed = {k: [] for k in observed}
            if not (counts or gauges or any(observed.values())):
                return
            self.flushes += 1
            for key, value in counts.items():
                self._guarded(self._increment, key, value)
            for name, value in gauges.items():
                self._guarded(self._set_gauge, name, value)
            for name, values in observed.items():
                if values:
                    self._guarded(self._observe, name, values)

    def close(self) -> None:
        """Stop the metrics thread after a last flush (idempotent)."""
        if self._closed:
            return
        self._closed = True
        self._stop.set()
        self._thread.join(timeout=10)

    def _loop(self) -> None:
        while not self._stop.wait(self._interval):
            self.flush()
        self.flush()

    def _guarded(self, apply, *args) -> None:
        try:
            apply(*args)
        except Exception:  # a metric must never take the server down
            self._log.log_warn(f"vlora: metrics update failed: {traceback.format_exc()}")

    def _increment(self, key: tuple, value: float) -> None:
        family = key[0]
        if family in self._fixed:
            metric = self._fixed[family]
        elif family in ("mode_seconds", "mode_steps"):
            seconds, steps, _ = self._modes[key[1]]
            metric = seconds if family == "mode_seconds" else steps
        else:
            metric = self._labelled(family, key[1:])
        metric.increment(value)
        self.ipc_calls += 1

    def _set(self, name: str, metric, value) -> None:
        """Set a gauge when its value differs from what was last set."""
        if self._applied.get(name) != value:
            metric.set(value)
            self.ipc_calls += 1
            self._applied[name] = value

    def _set_gauge(self, name: str, value) -> None:
        if name == "batch_last":
            self._set(name, self._batch_last, value)
        elif name == "depth":
            self._set("running", self._running, value[0])
            self._set("waiting", self._waiting, value[1])
        elif name == "mode":
            if value not in self._modes:
                raise KeyError(f"unknown inference mode {value!r}")
            for m, (_, _, gauge) in self._modes.items():
                self._set(f"mode_active:{m}", gauge, 1 if m == value else 0)
        elif name == "resident":
            self._set("resident:gpu", self._tiers["gpu"], value[0])
            self._set("resident:cpu", self._tiers["cpu"], value[1])
        elif name == "encoder_bytes":
            self._set(name, self._encoder["encoder_bytes"], value)
        elif name == "kv_usage":
            self._set(name, self._kv_usage, value)
        elif name == "adapters":
            self._set_adapter_gauges(*value)
            if self._lora_info_family is not None:
                self._set_lora_info(value[0], value[1])
        else:
            raise KeyError(f"unknown gauge {name!r}")

    def _observe(self, name: str, values: list[float]) -> None:
        # Triton's histograms take one observation per call: no bucket counts can be added at once.
        metric = self._histograms[name]
        for v in values:
            metric.observe(v)
        self.ipc_calls += len(values)

    def _labelled(self, family: str, values: tuple[str, ...]):
        key = (family,) + values
        metric = self._per_label.get(key)
        if metric is None:
            names = ("lora_name",) if family != "finished" else ("lora_name", "finish_reason")
            metric = self._families[family].Metric(labels={**self._labels, **dict(zip(names, values))})
            self._per_label[key] = metric
        return metric

    def _set_adapter_gauges(self, running: dict, waiting: dict, seen: set) -> None:
        """Per-adapter gauges; an adapter that had requests and has none now goes back to 0."""
        now = {(k or BASE_LABEL): (running.get(k, 0), waiting.get(k, 0)) for k in set(running) | set(waiting)}
        for name in sorted(set(now) | set(self._adapter_gauges) | seen):
            value = now.get(name, (0, 0))
            if self._adapter_gauges.get(name) != value:
                self._labelled("adapter_running", (name,)).set(value[0])
                self._labelled("adapter_waiting", (name,)).set(value[1])
                self.ipc_calls += 2
        self._adapter_gauges = dict(now)

    def _set_lora_info(self, running: dict, waiting: dict) -> None:
        """Make the label set of these adapters the LoRA info gauge's current one: its value becomes the time now
        (above every value set before, so the endpoint picker, which reads the series with the largest value,
        reads this one). Series of earlier label sets keep their older values: the Python backend cannot
        remove one series of a family. Once ``lora_info_series`` label sets exist, a new one goes into a fresh
        family of the same name (Triton merges families of one name) and the old family object is dropped,
        which removes its series; the new set is set first, so a scrape always finds the current one."""
        key = (_adapter_list(running), _adapter_list(waiting))
        if key == self._lora_info_current:
            return
        stamp = max(time.time(), self._lora_info_stamp + 0.001)
        metric = self._lora_info_series.get(key)
        if metric is None:
            family = self._lora_info_family
            rotate = len(self._lora_info_series) >= self._lora_info_cap
            if rotate:
                family = self._pb_family(*LORA_INFO, self._pb_family.GAUGE)
            metric = family.Metric(labels={**self._labels, "running_lora_adapters": key[0],
                                           "waiting_lora_adapters": key[1], "max_lora": str(self._max_lora)})
            metric.set(stamp)
            self.ipc_calls += 2
            if rotate:  # dropping the old family object removes its series (after the new one is set)
                self._lora_info_family, self._lora_info_series = family, {}
            self._lora_info_series[key] = metric
        else:
            metric.set(stamp)
            self.ipc_calls += 1
        self._lora_info_current, self._lora_info_stamp = key, stamp


def _adapter_list(counts: dict) -> str:
    """The LoRA info gauge's label value: the adapters (not the base model) with requests, sorted, joined by
    commas without spaces (the endpoint picker splits on ',')."""
    return ",".join(sorted(name for name, n in counts.items() if name and name != BASE_LABEL and n > 0))
