"""The iteration loop: continuous batching of prefill and decode, one packed forward per step.

``LLMEngine`` is synchronous and single-threaded (the engine thread of :mod:`vlora.engine.async_engine`
drives it; tests drive it directly). Each ``step()``:
1. finishes cancelled requests;
2. asks the orchestrator's policy for the next batch and inference mode (merge, unmerge, mixture),
   switches modes between steps, and admits picked waiting requests while the batch (MaxBS), the
   token budget, the KV cache and the adapter slots allow;
3. runs one packed forward over the batch's new tokens, ordered by adapter slot so that LoRA
   segments are contiguous;
4. samples, applies stop conditions, and reports each request's new text through its callback. A request
   with a ``task`` is answered by its adapter's task head from the prefill's hidden state, and finishes.
   A request whose logits are not finite fails alone; the others of the step go on.

With the step overlap (``engine.overlap``, on for CUDA), a step's forward and sampling are launched
(``_launch``) before the previous step's tokens are read back and processed (``_complete``): step 4 of
step N runs on the host while the GPU runs step N+1, whose decode rows read their token on the device.
Without it, each step is launched and completed in turn.

A waiting request is admitted only once its adapter is in a device slot and the copy into that slot has
completed (:meth:`LoraManager.try_acquire` answers "not yet" meanwhile, without blocking), so a request
whose adapter is being loaded waits for it while the others keep decoding.
"""
from __future__ import annotations

import hashlib
import logging
import time
from collections import Counter, deque
from dataclasses import dataclass, field
from typing import Callable, Optional

import numpy as np
import torch

from vlora.config import EngineConfig
from vlora.engine.api import GenerationOutput, InvalidRequest, OutputCallback, SamplingParams
from vlora.engine.kv_cache import SequenceBlocks
from vlora.engine.metrics import EngineMetrics, NullMetrics
from vlora.engine.model_runner import ModelRunner, SeqInput, StepResult
from vlora.engine.sampler import PendingSample, make_seed, sample_async
from vlora.lora.manager import LoraManager
from vlora.orchestrator.orchestrator import Orchestrator
from vlora.orchestrator.policies import UNMERGE, Candidate, Decision

log = logging.getLogger(__name__)


@dataclass
class PreparedRequest:
    """A validated request: token ids, preprocessed images, and everything the loop needs."""

    request_id: str
    prompt_ids: list[int]
    sampling: SamplingParams
    lora_name: Optional[str] = None
    stream: bool = False
    pixel_values: Optional[torch.Tensor] = None  # as the model family's vision tower takes them
    image_keys: tuple[bytes, ...] = ()
    task: Optional[str] = None
    image_grid_thw: Optional[torch.Tensor] = None  # [n_images, 3] (Qwen2-VL)
    mrope_positions: Optional[torch.Tensor] = None  # [3, len(prompt_ids)] (M-RoPE), None: 1-D positions
    rope_delta: int = 0  # generated tokens sit at their index plus this (M-RoPE)
    video: bool = False  # pixel_values are one video's frames (Qwen2-VL's video path)
    latency_target: Optional[float] = None  # seconds: this application's target, for the scheduler's credits
    arrival: float = field(default_factory=time.monotonic)


@dataclass(eq=False)  # compared by identity: the loop's `in` and `remove` must not compare every field
class Sequence:
    req: PreparedRequest
    callback: OutputCallback
    max_len: int  # prompt + output tokens this request may reach
    blocks: SequenceBlocks = field(default_factory=SequenceBlocks)
    slot: int = -1
    output_ids: list[int] = field(default_factory=list)
    text: str = ""
    sent: int = 0  # characters of text already reported
    seed: int = 0  # the sampling seed: the request's own, or drawn at admission
    # Incremental detokenization: text holds the decode of output_ids[:read_offset]; the next decode
    # covers output_ids[prefix_offset:], from a character boundary a few tokens back.
    prefix_offset: int = 0
    read_offset: int = 0
    pending_chars: int = 0  # characters of the window's new text already sent while its last one was incomplete
    prefilled: bool = False
    inflight: int = 0  # tokens sampled on the device and not read back yet (step overlap: at most 2)
    inflight_row: int = -1  # this sequence's row in the last step it was launched in
    finished: bool = False
    answer: Optional[dict] = None  # a task head's answer (task, label, labels, scores)
    candidate: Optional[Candidate] = None  # what the scheduling policy sees of this request

    @property
    def num_tokens(self) -> int:
        """Prompt and output tokens, those still in flight included."""
        return len(self.req.prompt_ids) + len(self.output_ids) + self.inflight

    @property
    def schedulable(self) -> bool:
        """False while the token in flight surely ends the request (its length, or a task head's answer):
        scheduling it again would only compute a row to discard."""
        if not self.inflight:
            return True
        if self.req.task is not None:
            return False
        return len(self.output_ids) + self.inflight < self.req.sampling.max_tokens and self.num_tokens < self.max_len

    prefix_hashes: list = field(default_factory=list)  # the prefix cache's hash of each full prompt block
    prefix_identity: Optional[str] = None  # the adapter weights prefix_hashes were made for
    cached_tokens: int = 0  # prompt tokens whose KV came from the prefix cache (a whole number of blocks)

    @property
    def step_tokens(self) -> int:
        """Tokens this request puts into its next step: the prompt (less its cached prefix), then one at a time."""
        return 1 if self.prefilled else len(self.req.prompt_ids) - self.cached_tokens


class LLMEngine:
    def __init__(self, config: EngineConfig, runner: ModelRunner, loras: LoraManager, tokenizer,
                 max_model_len: int, eos_ids: set[int], metrics: Optional[EngineMetrics] = None) -> None:
        self.config = config
        self.runner = runner
        self.loras = loras
        self.tokenizer = tokenizer
        self.max_model_len = max_model_len
        self.eos_ids = eos_ids
        self.metrics = metrics or NullMetrics()
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self._aborted: set[str] = set()
        self._unloading: dict[str, list[Callable[[dict], None]]] = {}  # adapter -> who waits for its unload
        self.last_step: Optional[dict] = None  # what the last step ran; read by tests and benchmarks
        self.inputs = None  # the InputProcessor that prepares requests for this engine (set by build_engine)
        self.model_info: dict = {}
        self.orchestrator = Orchestrator(config.orchestrator, config.scheduler.max_batch_size, runner, loras, self.metrics)
        self._reported: tuple = ()  # the per-adapter counts and residency last sent to the metrics
        self._reported_depth: Optional[tuple[int, int]] = None  # (running, waiting) last sent to the metrics
        self.tuner = None  # the ATMM tuner sidecar started at model load (vlora.atmm.tuner.start_at_load), if any
        self._decode = _fast_decode(tokenizer)
        self.prefix_stats = {"queried_tokens": 0, "reused_tokens": 0, "evictions": 0}  # cache.prefix_caching
        self._encoder_reported: dict = {}  # the encoder cache's counters last sent to the metrics
        mode = config.engine.overlap
        self.overlap = mode == "on" or (mode == "auto" and runner.device.type == "cuda")
        self._inflight: Optional[_Launched] = None  # the launched step whose tokens are not read back yet
        self._last_done = 0.0  # when the last step's tokens were read back

    # -- queue -------------------------------------------------------------------------------
    def add_request(self, req: PreparedRequest, callback: OutputCallback) -> None:
        max_len = min(self.max_model_len, len(req.prompt_ids) + (1 if req.task else req.sampling.max_tokens))
        seq = Sequence(req=req, callback=callback, max_len=max_len, seed=make_seed(req.sampling))
        seq.candidate = Candidate(req.request_id, req.lora_name, self.orchestrator.clock(),
                                  self.orchestrator.latency_target(req.lora_name, req.latency_target),
                                  remaining=max_len - len(req.prompt_ids))
        self.waiting.append(seq)
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
            self._report_adapters()
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
        batch, new = self._schedule()
        launched = self._launch(batch, new) if batch else None
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
        inputs = []
        prev = self._inflight
        for s in batch:
            plus, minus = orch.lora_slots(s.slot)
            req = s.req
            if s.prefilled:
                if s.inflight:
                    token, row = 0, s.inflight_row
                else:
                    token, row = s.output_ids[-1], -1
                inputs.append(SeqInput([token], s.num_tokens - 1, s.blocks, plus, delora_slot=minus,
                                       rope_delta=req.rope_delta, pending_row=row))
            else:  # the prompt past its cached prefix; the runner takes the images' features that fall there
                c = s.cached_tokens
                # The vision side is never merged: the images go through the adapter's own slot, whatever the mode.
                vision_slot, vision_identity = self.loras.vision_side(s.slot)
                inputs.append(SeqInput(req.prompt_ids[c:], c, s.blocks, plus, delora_slot=minus,
                                       pixel_values=req.pixel_values, image_keys=req.image_keys,
                                       image_grid_thw=req.image_grid_thw, mrope_positions=req.mrope_positions,
                                       rope_delta=req.rope_delta, video=req.video, vision_slot=vision_slot,
                                       vision_identity=vision_identity))
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
        n_prefill = sum(s.step_tokens for s in batch if not s.prefilled)
        alloc = self.runner.kv.allocator
        heads = {}
        for i, s in enumerate(batch):
            if not s.prefilled:
                for block, h in zip(s.blocks.blocks, s.prefix_hashes):  # the prompt's full blocks now hold its KV
                    alloc.register(block, h)
                if s.req.task is not None:
                    heads[i] = result.hidden[i]
            s.prefilled = True
            s.inflight += 1
            s.inflight_row = i
        self.last_step = {
            "request_ids": [s.req.request_id for s in batch],
            "num_prefill": n_prefill_reqs,
            "num_decode": len(batch) - n_prefill_reqs,
            "slots": [s.slot for s in batch],
            "admitted": [s.req.request_id for s in new],
            "mode": orch.mode,
            "merged": orch.merged,
            "paused": [s.req.request_id for s in self.running if s not in batch],
        }
        cache = self.runner.encoder_cache
        if cache is not None and n_prefill_reqs:
            now_stats = cache.stats()
            last = self._encoder_reported
            self.metrics.encoder_cache(*(now_stats[k] - last.get(k, 0) for k in ("hits", "misses", "evictions")),
                                       now_stats["bytes"])
            self._encoder_reported = now_stats
        return _Launched(batch, inputs, result, sampled, heads, t0, n_prefill_reqs, n_prefill)

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
            self._advance(s, tok)
        self.metrics.step(len(batch), step.n_prefill, len(batch) - step.n_prefill_reqs, elapsed)
        self.metrics.mode_step(orch.mode, orch.merged, elapsed)
        self.metrics.queue_depth(len(self.running), len(self.waiting))

    def _schedule(self) -> tuple[list[Sequence], list[Sequence]]:
        """Ask the policy for the next batch and mode, switch, then admit what fits.

        The batch comes from every known request, running or waiting; a running request the policy
        leaves out waits with its KV cache intact. Waiting requests are admitted (KV blocks reserved
        for prompt + max_tokens, adapter slot pinned) when they are picked and there is room.
        """
        cands = [s for s in self.running if s.schedulable] + list(self.waiting)
        if not cands:
            return [], []
        orch = self.orchestrator
        decision = orch.decide([s.candidate for s in cands])
        if not orch.enter(decision.mode, decision.merged):  # the adapter to merge found no free slot
            decision = self._fifo_unmerged(cands)
        batch, new = self._fill(decision.batch, cands)
        if not batch and orch.mode != UNMERGE:  # nothing of that mode fits now: make progress unmerged
            decision = self._fifo_unmerged(cands)
            batch, new = self._fill(decision.batch, cands)
        orch.mode_impl.check([s.slot for s in batch], orch.merged_slot)
        return sorted(batch, key=lambda s: orch.lora_slots(s.slot)), new

    def _fifo_unmerged(self, cands: list[Sequence]) -> Decision:
        self.orchestrator.enter(UNMERGE, None)
        return Decision(UNMERGE, None, sorted((s.candidate for s in cands), key=lambda c: c.last_served))

    def _fill(self, picked, cands: list[Sequence]) -> tuple[list[Sequence], list[Sequence]]:
        sch = self.config.scheduler
        by_id = {s.req.request_id: s for s in cands}
        budget = sch.max_num_batched_tokens
        batch: list[Sequence] = []
        new: list[Sequence] = []
        for c in picked:
            if len(batch) >= sch.max_batch_size:
                break
            s = by_id[c.request_id]
            n = s.step_tokens
            if s not in self.running:
                # A waiting prompt is charged what it will run: its length less the cached prefix that
                # admission finds. Without the prefix cache that is its whole length, known now.
                if n > budget and batch and not self.config.cache.prefix_caching:
                    continue
                if not self._admit_one(s):
                    continue
                new.append(s)
                n = s.step_tokens
                if n > budget and batch:
                    continue  # admitted (its blocks and slot held): it runs in a later step
            elif n > budget and batch:
                continue  # a prompt larger than the whole budget still runs, alone
            batch.append(s)
            budget -= n
        # Top up with running requests the mode can serve, so a request that could run never idles
        # because the policy's pick could not be admitted.
        orch = self.orchestrator
        for s in sorted(self.running, key=lambda s: s.candidate.last_served):
            if len(batch) >= sch.max_batch_size:
                break
            n = s.step_tokens
            if s in batch or not s.schedulable or (n > budget and batch) or not orch.mode_impl.accepts(s.slot, orch.merged_slot):
                continue
            batch.append(s)
            budget -= n
        return batch, new

    def _admit_one(self, s: Sequence) -> bool:
        """Reserve KV blocks and pin an adapter slot for a waiting request; False: it waits."""
        if len(self.running) >= self.config.scheduler.max_batch_size:
            return False
        need = self.runner.kv.blocks_for(s.max_len)
        if need > self.runner.kv.num_blocks:
            self.waiting.remove(s)
            self._finish(s, "error", error=f"request needs {need} KV blocks, the cache has {self.runner.kv.num_blocks}")
            return False
        try:
            # Asked before the KV check so that a load starts (and overlaps) even while the cache is full.
            slot = self.loras.try_acquire(s.req.lora_name)
        except InvalidRequest as e:  # unloaded, or its folder broke since the request was validated
            self.waiting.remove(s)
            self._finish(s, "error", error=str(e))
            return False
        if slot is None:
            return False  # its adapter is being read or copied, or every slot is pinned: a later step
        alloc = self.runner.kv.allocator
        hit: list[int] = []
        if self.config.cache.prefix_caching:
            identity = self.loras.slot_identity(slot)
            if s.prefix_identity != identity:  # a request that waits for memory is tried again every step
                s.prefix_hashes, s.prefix_identity = self._prefix_hashes(s, identity), identity
            hit = alloc.lookup(s.prefix_hashes)
            alloc.share(hit)  # held before the allocation below, which may evict other cached blocks
        if need - len(hit) > alloc.num_free:
            alloc.free(hit)
            self.loras.release(slot)
            return False
        self.waiting.remove(s)
        s.slot = slot
        s.blocks = SequenceBlocks(hit + alloc.allocate(need - len(hit)))
        s.cached_tokens = len(hit) * self.runner.kv.block_size
        self.prefix_stats["queried_tokens"] += len(s.req.prompt_ids)
        self.prefix_stats["reused_tokens"] += s.cached_tokens
        evicted = alloc.evictions - self.prefix_stats["evictions"]
        self.prefix_stats["evictions"] = alloc.evictions
        self.metrics.prefix_cache(len(s.req.prompt_ids), s.cached_tokens, evicted)
        self.running.append(s)
        s.candidate.running = True
        return True

    def _prefix_hashes(self, s: Sequence, identity: str) -> list[bytes]:
        """Chained hashes of the prompt's full blocks, leaving at least one token to run (its logits).

        Block i's hash covers the weights that made the KV (``identity``: the adapter's name and version, "" for the
        base model), blocks 0..i's token ids, and the content hashes of the images (or video) whose
        placeholder tokens start in blocks 0..i: a block is shared only by requests that would have
        computed the same keys and values."""
        bs = self.runner.kv.block_size
        ids = s.req.prompt_ids
        n_full = (len(ids) - 1) // bs
        if n_full <= 0:
            return []
        starts: dict[int, list[bytes]] = {}  # block -> keys of the images starting there
        req = s.req
        if req.pixel_values is not None and len(req.image_keys):
            loaded = self.runner.loaded
            family = loaded.family
            counts = family.item_tokens(loaded, req.pixel_values, req.image_grid_thw, req.video)
            marker = family.placeholder_id(loaded, req.video)
            positions = [i for i, t in enumerate(ids) if t == marker]
            first = 0
            for key, n in zip(req.image_keys, counts):
                if first < len(positions):
                    starts.setdefault(positions[first] // bs, []).append(key)
                first += n
        h = hashlib.sha256(b"vlora-prefix\0" + identity.encode()).digest()
        out = []
        for i in range(n_full):
            m = hashlib.sha256(h)
            m.update(np.asarray(ids[i * bs:(i + 1) * bs], dtype=np.int64).tobytes())
            for key in starts.get(i, ()):
                m.update(key)
            h = m.digest()
            out.append(h)
        return out

    # -- stopping and reporting ----------------------------------------------------------------
    def _advance(self, s: Sequence, tok: int) -> None:
        sp = s.req.sampling
        reason = None
        if tok in self.eos_ids and not sp.ignore_eos:
            reason = "stop"
        if reason is None and len(s.output_ids) >= sp.max_tokens:
            reason = "length"
        if reason is None and len(s.req.prompt_ids) + len(s.output_ids) >= s.max_len:  # a token in flight is not counted
            reason = "length"
        old_len = len(s.text)
        # A finishing request takes its incomplete last character too, as a full decode would show it.
        text = s.text + self._decode_delta(s, final=reason is not None)
        if sp.stop:
            # The text only grows, and an earlier match would have stopped the request already: only
            # matches that reach into the new text are looked for.
            found = (text.find(x, max(0, old_len - len(x) + 1)) for x in sp.stop)
            cut = min((i for i in found if i >= 0), default=-1)
            if cut >= 0:
                text, reason = text[:cut], "stop"
        s.text = text
        if reason is not None:
            self._finish(s, reason)
        elif s.req.stream:
            hold = max((len(x) for x in sp.stop), default=1) - 1
            upto = len(text) - hold  # text never ends in an incomplete character: _decode_delta waits
            if upto > s.sent:
                self._emit(s, GenerationOutput(s.req.request_id, text[s.sent:upto], text[:upto], False,
                                               num_input_tokens=len(s.req.prompt_ids), num_output_tokens=len(s.output_ids)))
                s.sent = upto

    def _decode_delta(self, s: Sequence, final: bool = False) -> str:
        """The text that ``s.output_ids`` add to ``s.text``, decoding only the last few tokens.

        As vLLM's incremental detokenizer: decode ids[prefix:] and ids[prefix:read] and return the
        difference. Both decodes start on the same character boundary, so the difference is what a full
        decode adds. While the new text ends in an incomplete UTF-8 sequence, the offsets stay (the
        window grows until the character completes) and only the text before its replacement character
        goes out: a trailing incomplete sequence decodes to exactly one "\ufffd", so everything before it
        is final (a model that keeps emitting stray byte tokens still streams). ``final`` returns the
        pending text as it stands.
        """
        ids = s.output_ids
        decode = self._decode
        before = decode(ids[s.prefix_offset:s.read_offset]) if s.read_offset > s.prefix_offset else ""
        after = decode(ids[s.prefix_offset:])
        if len(after) <= len(before):  # nothing new yet (a skipped special token)
            return ""
        new = after[len(before):]
        if new.endswith("\ufffd") and not final:
            ready = new[:-1]
            out = ready[s.pending_chars:]
            s.pending_chars = max(s.pending_chars, len(ready))
            return out
        s.prefix_offset, s.read_offset = s.read_offset, len(ids)
        out = new[s.pending_chars:]
        s.pending_chars = 0
        return out

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
        if s in self.running:
            self.running.remove(s)
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
        if s.req.lora_name in self._unloading:  # the last request of an adapter being unloaded completes it
            try:
                self._complete_unload(s.req.lora_name)
            except Exception:  # the step goes on; the adapter stays "unloading" and the error is logged
                log.exception("completing the unload of %s failed", s.req.lora_name)

    def _emit(self, s: Sequence, out: GenerationOutput) -> None:
        try:
            s.callback(out)
        except Exception:  # a broken consumer must not stop the loop
            log.exception("output callback failed for %s", s.req.request_id)

    def _process_aborts(self) -> None:
        if not self._aborted:
            return
        ids, self._aborted = self._aborted, set()
        for s in [x for x in self.running if x.req.request_id in ids]:
            self._finish(s, "cancelled")
        for s in [x for x in self.waiting if x.req.request_id in ids]:
            self.waiting.remove(s)
            self._finish(s, "cancelled")

    # -- adapters (engine thread) ---------------------------------------------------------------
    def adapter_requests(self) -> dict[Optional[str], tuple[int, int]]:
        """(running, waiting) requests per adapter name (None: the base model)."""
        running = Counter(s.req.lora_name for s in self.running)
        waiting = Counter(s.req.lora_name for s in self.waiting)
        return {name: (running[name], waiting[name]) for name in set(running) | set(waiting)}

    def describe_adapters(self, names=None) -> list[dict]:
        """The adapter registry as a client lists it: the manager's entries plus requests and merge state."""
        counts = self.adapter_requests()
        out = self.loras.describe(names)
        for entry in out:
            entry["running"], entry["waiting"] = counts.get(entry["name"], (0, 0))
            entry["merged"] = entry["name"] == self.orchestrator.merged
        return out

    def unload_adapter(self, name: str, on_unloaded: Optional[Callable[[dict], None]] = None) -> dict:
        """Unload ``name``, deferred while requests use it.

        New requests for it are refused at once (LoraManager.begin_unload); its running and waiting
        requests finish, and the last one to finish completes the unload (a merge of it is undone
        first). Returns its entry: ``state`` "unloading" until then, "unloaded" after.
        ``on_unloaded(entry)`` is called on this thread when the unload completes (at once when no
        request uses it). Unloading twice is not an error.
        """
        self.loras.begin_unload(name)
        waiters = self._unloading.setdefault(name, [])
        if on_unloaded is not None:
            waiters.append(on_unloaded)
        self._complete_unload(name)
        return self._adapter_entry(name)

    def _complete_unload(self, name: str) -> None:
        """Unload ``name`` (being unloaded) once no request runs or waits for it, and tell its waiters."""
        if name not in self._unloading or name in self.adapter_requests():
            return
        if self.orchestrator.merged == name:
            self.orchestrator.enter(UNMERGE, None)
        self.loras.unload(name)
        entry = self._adapter_entry(name)
        for notify in self._unloading.pop(name):
            try:
                notify(entry)
            except Exception:
                log.exception("an unload waiter of %s failed", name)

    def _adapter_entry(self, name: str) -> dict:
        entries = self.describe_adapters([name])
        return entries[0] if entries else {"name": name, "id": self.loras.adapter_id(name), "loaded": False,
                                           "state": "unloaded"}

    def _report_adapters(self) -> None:
        running = Counter(s.req.lora_name for s in self.running)
        waiting = Counter(s.req.lora_name for s in self.waiting)
        resident = self.loras.resident_counts()
        if (running, waiting, resident) == self._reported:
            return
        old = self._reported
        self._reported = (running, waiting, resident)
        if not old or (running, waiting) != old[:2]:
            self.metrics.adapter_requests(dict(running), dict(waiting))
        if not old or resident != old[2]:
            self.metrics.adapters_resident(*resident)

    def fail_all(self, reason: str, error: Optional[str] = None) -> None:
        for s in list(self.running) + list(self.waiting):
            if s in self.waiting:
                self.waiting.remove(s)
            self._finish(s, reason, error)
        self._report_queue_depth()


@dataclass(eq=False)
class _Launched:
    """A step whose forward and sampling are queued on the device, tokens not read back yet."""

    batch: list[Sequence]
    inputs: list[SeqInput]
    result: StepResult
    sampled: PendingSample
    heads: dict  # batch row -> hidden state, for the rows a task head answers
    t0: float
    n_prefill_reqs: int
    n_prefill: int


def _fast_decode(tokenizer):
    """``ids -> text`` as ``tokenizer.decode(ids, skip_special_tokens=True)``. A fast tokenizer without
    clean-up is called directly on its Rust backend, skipping the wrapper's argument conversions (five
    times the decode itself, per token of every request)."""
    backend = getattr(tokenizer, "_tokenizer", None)
    if backend is not None and hasattr(backend, "decode") and not getattr(tokenizer, "clean_up_tokenization_spaces", True):
        return lambda ids: backend.decode(ids, skip_special_tokens=True)
    return lambda ids: tokenizer.decode(ids, skip_special_tokens=True)
