"""The iteration loop: continuous batching of prefill and decode, one packed forward per step.

``LLMEngine`` is synchronous and single-threaded (the engine thread of :mod:`vlora.engine.async_engine`
drives it; tests drive it directly). Each ``step()``:
1. finishes cancelled requests;
2. asks the orchestrator's policy for the next batch and inference mode (merge, unmerge, mixture),
   switches modes between steps, and admits picked waiting requests while the batch (MaxBS), the
   token budget, the KV cache and the adapter slots allow;
3. runs one packed forward over the batch's new tokens (a decode's one token, a prompt's next chunk: see
   :mod:`vlora.engine.scheduler` on chunked prefill), ordered by adapter slot so that LoRA segments are contiguous;
4. samples, applies stop conditions, and reports each request's new text through its callback. A request
   with a ``task`` is answered by its adapter's task head from the prefill's hidden state, and finishes.
   A request whose logits are not finite fails alone; the others of the step go on. A prompt's chunk that
   stops before the prompt's end samples nothing (its row is discarded) and registers the prefix-cache blocks it
   completed; the request's first token, stop conditions and task head come after its last chunk.

With the step overlap (``engine.overlap``, on for CUDA), a step's forward and sampling are launched
(``_launch``) before the previous step's tokens are read back and processed (``_complete``): step 4 of
step N runs on the host while the GPU runs step N+1, whose decode rows read their token on the device.
Without it, each step is launched and completed in turn.

A waiting request is admitted only once its adapter is in a device slot and the copy into that slot has
completed (:meth:`LoraManager.try_acquire` answers "not yet" meanwhile, without blocking), so a request
whose adapter is being loaded waits for it while the others keep decoding.
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Callable, Optional

import torch

from vlora.config import EngineConfig
from vlora.engine.api import GenerationOutput, OutputCallback, PreparedRequest, StepResult
from vlora.engine.kv_cache import SequenceBlocks
from vlora.metrics import EngineMetrics, NullMetrics
from vlora.engine.model_runner import ModelRunner, SeqInput
from vlora.engine.adapter_requests import AdapterRequests
from vlora.engine.output import OutputProcessor
from vlora.engine.sampler import PendingSample, sample_async
from vlora.engine.scheduler import Scheduler
from vlora.engine.sequence import Sequence
from vlora.engine.step_inputs import step_inputs
from vlora.lora.manager import LoraManager
from vlora.orchestrator.orchestrator import Orchestrator

log = logging.getLogger(__name__)


class LLMEngine:
    def __init__(self, config: EngineConfig, runner: ModelRunner, loras: LoraManager, tokenizer,
                 max_model_len: int, eos_ids: set[int], metrics: Optional[EngineMetrics] = None,
                 inputs=None, model_info: Optional[dict] = None, tuner=None,
                 orchestrator: Optional[Orchestrator] = None) -> None:
        """``inputs``: the InputProcessor that prepares requests for this engine; ``model_info``: what the
        builder found (name, dtype, device, graphs...), shown to clients; ``tuner``: the ATMM tuner sidecar
        started at model load (vlora.atmm.tuner.start_at_load), whose table is swapped in between steps;
        ``orchestrator``: the builder's, which placed the weights before the graphs were captured (None: a
        new one over ``runner`` and ``loras``)."""
        self.config = config
        self.runner = runner
        self.loras = loras
        self.tokenizer = tokenizer
        self.max_model_len = max_model_len
        self.metrics = metrics or NullMetrics()
        self._aborted: set[str] = set()
        self.inputs = inputs
        self.model_info: dict = model_info if model_info is not None else {}
        self.orchestrator = orchestrator if orchestrator is not None else Orchestrator(
            config.orchestrator, config.scheduler.max_batch_size, runner, loras, self.metrics)
        self.scheduler = Scheduler(config, runner.kv, loras, self.orchestrator, runner.loaded, self.metrics, max_model_len)
        self.adapters = AdapterRequests(loras, self.scheduler, self.metrics)
        self._reported_depth: Optional[tuple[int, int]] = None  # (running, waiting) last sent to the metrics
        self.tuner = tuner
        self.output = OutputProcessor(tokenizer, eos_ids)
        self._encoder_reported: dict = {}  # the encoder cache's counters last sent to the metrics
        mode = config.engine.overlap
        self.overlap = mode == "on" or (mode == "auto" and runner.device.type == "cuda")
        self._inflight: Optional[_Launched] = None  # the launched step whose tokens are not read back yet
        self._last_done = 0.0  # when the last step's tokens were read back

    # -- queue -------------------------------------------------------------------------------
    @property
    def waiting(self):
        """The scheduler's waiting queue (read-only use)."""
        return self.scheduler.waiting

    @property
    def running(self) -> list[Sequence]:
        """The scheduler's admitted requests (read-only use)."""
        return self.scheduler.running

    @property
    def prefix_stats(self) -> dict:
        return self.scheduler.prefix_stats

    @property
    def eos_ids(self) -> set[int]:
        """The token ids that end a request (unless it ignores them)."""
        return self.output.eos_ids

    @eos_ids.setter
    def eos_ids(self, ids: set[int]) -> None:
        self.output.eos_ids = ids

    def use_orchestrator(self, orchestrator: Optional[Orchestrator]) -> None:
        """Serve with another orchestrator (a benchmark switching policies on an idle engine)."""
        self.orchestrator = self.scheduler.orchestrator = orchestrator

    def add_request(self, req: PreparedRequest, callback: OutputCallback) -> None:
        self.scheduler.add(req, callback)
        self.loras.prefetch(req.lora_name)  # its adapter's read overlaps the steps before its admission
        self.metrics.request_admitted(req.lora_name)

    def abort(self, request_id: str) -> None:
        self._aborted.add(request_id)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running or self._inflight)

    # -- the step ----------------------------------------------------------------------------
    def step(self) -> Optional[StepResult]:
        """One iteration; None when nothing ran (nothing to do, every pick still waits for its adapter,
        or the step failed and failed its requests)."""
        try:
            return self._step()
        finally:
            self._report_queue_depth()
            self.adapters.report()
            if self.tuner is not None and self.tuner.poll():  # swap the tuned tiling table in between steps
                self.model_info["atmm_tiling_table"] = self.tuner.kernels.table_source
                self.tuner = None

    def _report_queue_depth(self) -> None:
        """Send (running, waiting) when it changed since the last report. Also after a step that ran
        nothing (its requests were all cancelled, or failed): otherwise the gauges would keep the old
        depth until the next request comes."""
        depth = (len(self.running), len(self.waiting))
        if depth != self._reported_depth:
            self._reported_depth = depth
            self.metrics.queue_depth(*depth)

    def _step(self) -> Optional[StepResult]:
        self._process_aborts()
        plan = self.scheduler.schedule()
        for s, error in plan.failed:
            self._finish(s, "error", error=error)
        batch = plan.batch
        launched = self._launch(batch, plan.admitted) if batch else None
        prev, self._inflight = self._inflight, None
        if prev is not None:  # the last step's tokens, read back while the GPU runs this one
            self._complete(prev)
        if launched is None:
            return prev.result if prev is not None else None
        if self.overlap:
            self._inflight = launched
        else:
            self._complete(launched)
        return launched.result

    def flush(self) -> None:
        """Complete the step in flight (step overlap): its tokens are read back and reported."""
        prev, self._inflight = self._inflight, None
        if prev is not None:
            self._complete(prev)

    def _launch(self, batch: list[Sequence], new: list[Sequence]) -> Optional["_Launched"]:
        """Run the batch's forward and sampling, without waiting for the sampled tokens.

        A decode sequence whose last token is still in flight (the previous step, not read back yet)
        reads it on the device, from that step's sampled ids."""
        t0 = time.perf_counter()
        orch = self.orchestrator
        prev = self._inflight
        inputs = step_inputs(batch, orch, self.loras, self.runner.loaded, self.metrics)
        try:
            # The copies into the slots this step reads were issued on the side stream: order them first.
            self.loras.wait_ready([s.slot for s in batch] + [orch.merged_slot if orch.merged_slot is not None else -1])
            result = self.runner.forward(inputs, prev.sampled.tokens if prev is not None else None)
            sampled = sample_async(result.logits, [s.req.sampling for s in batch], [s.seed for s in batch],
                                   [len(s.output_ids) + s.inflight for s in batch])
        except Exception as e:  # a failed step fails its requests, not the server
            log.exception("step failed")
            for s in batch:
                self._finish(s, "error", error=f"internal error during inference: {e}")
            return None
        n_prefill_reqs = sum(1 for s in batch if not s.prefilled)
        n_prefill = sum(s.chunk for s in batch if not s.prefilled)
        alloc = self.runner.kv.allocator
        bs = self.runner.kv.block_size
        heads = {}
        partial: set[int] = set()  # rows whose prompt goes on in a later chunk: nothing is sampled for them
        for i, s in enumerate(batch):
            if not s.prefilled:
                c, end = s.computed, s.computed + s.chunk
                # The prompt's blocks this chunk completes now hold their KV (launched: later steps read it in
                # stream order), so later requests may share them.
                for j in range(c // bs, min(end // bs, len(s.prefix_hashes))):
                    alloc.register(s.blocks.blocks[j], s.prefix_hashes[j])
                s.computed = end
                if end < len(s.req.prompt_ids):
                    partial.add(i)
                    continue
                s.held_features = None
                if s.req.task is not None:
                    heads[i] = result.hidden[i]
            s.prefilled = True
            s.inflight += 1
            s.inflight_row = i
        step = StepResult(
            request_ids=[s.req.request_id for s in batch], num_prefill=n_prefill_reqs,
            num_decode=len(batch) - n_prefill_reqs, slots=[s.slot for s in batch],
            admitted=[s.req.request_id for s in new], mode=orch.mode, merged=orch.merged,
            paused=[s.req.request_id for s in self.running if s not in batch],
            logits=result.logits, hidden=result.hidden, num_images_encoded=result.num_images_encoded,
            num_prefill_tokens=n_prefill, partial_prefills=[batch[i].req.request_id for i in sorted(partial)])
        cache = self.runner.encoder_cache
        if cache is not None and n_prefill_reqs:
            now_stats = cache.stats()
            last = self._encoder_reported
            self.metrics.encoder_cache(*(now_stats[k] - last.get(k, 0) for k in ("hits", "misses", "evictions")),
                                       now_stats["bytes"])
            self._encoder_reported = now_stats
        return _Launched(batch, inputs, step, sampled, heads, t0, n_prefill_reqs, n_prefill, partial)

    def _complete(self, step: "_Launched") -> None:
        """Read a launched step's tokens back; stop, detokenize and report. A sequence that finished
        meanwhile (cancelled, failed, or stopped by its previous token) takes nothing from it."""
        batch = step.batch
        try:
            sampled = step.sampled.result()
        except Exception as e:
            log.exception("step failed")
            for s in batch:
                if not s.finished:
                    self._finish(s, "error", error=f"internal error during inference: {e}")
            return
        t_done = time.perf_counter()
        elapsed = t_done - max(step.t0, self._last_done)  # overlapped steps: the interval between completions
        self._last_done = t_done
        orch = self.orchestrator
        orch.observe_step(elapsed, step.inputs)
        now = orch.clock()
        bad = set(sampled.bad_rows)
        for i, (s, tok) in enumerate(zip(batch, sampled.tokens)):
            if s.finished:
                continue
            if i in step.partial:  # a chunk of a prompt that goes on: its row's sample is discarded
                s.candidate.last_served = now
                continue
            s.inflight -= 1
            s.candidate.last_served = now
            s.candidate.remaining = s.max_len - len(s.req.prompt_ids) - len(s.output_ids) - 1  # after this step's token
            if i in step.heads:
                self._answer_with_head(s, step.heads[i])
                continue
            if i in bad:  # this request alone fails; its neighbours in the batch carry on
                log.warning("non-finite logits for request %s (adapter %s)", s.req.request_id, s.req.lora_name)
                self._finish(s, "error", error=f"non-finite logits (NaN or inf) for this request "
                                               f"(adapter {s.req.lora_name!r}); generation stopped")
                continue
            s.output_ids.append(tok)
            reason, event = self.output.advance(s, tok)
            if reason is not None:
                self._finish(s, reason)
            elif event is not None:
                self._emit(s, event)
        self.metrics.step(len(batch), step.n_prefill, len(batch) - step.n_prefill_reqs, elapsed)
        self.metrics.stage("prefill_step" if step.n_prefill_reqs else "decode_step", elapsed)
        for seconds in self.runner.vision_times():  # the encodes of this step and those before it, now measured
            self.metrics.stage("vision", seconds)
        self.metrics.mode_step(orch.mode, orch.merged, elapsed)
        self.metrics.queue_depth(len(self.running), len(self.waiting))

    # -- stopping and reporting ----------------------------------------------------------------
    def _answer_with_head(self, s: Sequence, hidden: torch.Tensor) -> None:
        """A head request ends with its prefill: its text is the label, and it counts as one output token
        (one answer from one forward pass, where generating the label would take several)."""
        s.prefilled = True
        head = self.loras.head(s.slot, s.req.task)
        if head is None:
            self._finish(s, "error", error=f"task head {s.req.task!r} is not loaded for adapter {s.req.lora_name!r}")
            return
        label, scores = head.answer(hidden)
        s.text = label
        s.answer = {"task": head.task, "label": label, "labels": list(head.labels), "scores": scores}
        self._finish(s, "stop")

    def _finish(self, s: Sequence, reason: str, error: Optional[str] = None) -> None:
        s.finished = True
        s.held_features = None
        self.scheduler.remove(s)
        if s.blocks.blocks:
            self.runner.kv.allocator.free(s.blocks.blocks)
            s.blocks = SequenceBlocks()
            self.loras.release(s.slot)
        n_out = 1 if s.answer is not None else len(s.output_ids)
        out = GenerationOutput(s.req.request_id, s.text[s.sent:], s.text, True, finish_reason=reason,
                               num_input_tokens=len(s.req.prompt_ids), num_output_tokens=n_out, error=error,
                               extra=dict(s.answer or {}))
        s.sent = len(s.text)
        self.metrics.request_finished(s.req.lora_name, reason, n_out)
        self._emit(s, out)
        self.adapters.request_finished(s.req.lora_name)

    def _emit(self, s: Sequence, out: GenerationOutput) -> None:
        try:
            s.callback(out)
        except Exception:  # a broken consumer must not stop the loop
            log.exception("output callback failed for %s", s.req.request_id)

    def _process_aborts(self) -> None:
        if not self._aborted:
            return
        ids, self._aborted = self._aborted, set()
        for s in [x for x in list(self.running) + list(self.waiting) if x.req.request_id in ids]:
            self._finish(s, "cancelled")

    # -- adapters (engine thread) ---------------------------------------------------------------
    def describe_adapters(self, names=None) -> list[dict]:
        return self.adapters.describe(names)

    def unload_adapter(self, name: str, on_unloaded: Optional[Callable[[dict], None]] = None) -> dict:
        return self.adapters.unload(name, on_unloaded)

    def fail_all(self, reason: str, error: Optional[str] = None) -> None:
        for s in list(self.running) + list(self.waiting):
            self._finish(s, reason, error)
        self._report_queue_depth()


@dataclass(eq=False)
class _Launched:
    """A step whose forward and sampling are queued on the device, tokens not read back yet."""

    batch: list[Sequence]
    inputs: list[SeqInput]
    result: StepResult  # what the step ran, with its forward's logits and hidden states
    sampled: PendingSample
    heads: dict  # batch row -> hidden state, for the rows a task head answers
    t0: float
    n_prefill_reqs: int
    n_prefill: int
    partial: set  # rows of prefill chunks that did not reach their prompt's end (no token)
