"""The scheduler: which requests run in the next step, in which inference mode.

One call, :meth:`Scheduler.schedule`, returns the step's batch. It asks the orchestrator's policy (the
V-LoRA paper's Algorithm 1, or a baseline) for the next batch and mode over every known request, running
or waiting; switches the mode; admits the picked waiting requests while the batch (MaxBS), the token
budget (``scheduler.max_num_batched_tokens``), the KV cache and the adapter slots allow; and tops the
batch up with running requests the mode can serve. A running request left out waits with its KV cache
intact. Admission reserves KV blocks for prompt + max_tokens (reusing the prefix cache's blocks of the
same adapter version, tokens and images) and pins the adapter's device slot; a request whose adapter is
still being read or copied is not admitted and waits while the others run.

The batch comes back ordered by adapter slot, so that LoRA segments are contiguous. Requests that can
never run (more KV than the cache holds, an adapter unloaded since they were checked) come back in
``failed``, for the engine to answer.

Chunked prefill (``scheduler.chunked_prefill``, on by default; Sarathi-Serve's stall-free batching): each
step takes the running decodes first, one token each, and gives the prompts chunks of the budget left, so a
prompt longer than the budget runs over several steps while the decoders keep producing a token every step,
and many short prompts share one step. Each sequence keeps its prefill position (``Sequence.computed``); the
scheduler writes each step's ``Sequence.chunk``. Off, a prompt runs whole in one step, alone when it is
larger than the budget.
"""
from __future__ import annotations

import hashlib
from collections import deque
from dataclasses import dataclass, field
from typing import Optional

import numpy as np

from vlora.config import EngineConfig
from vlora.engine.api import InvalidRequest, PreparedRequest
from vlora.engine.kv_cache import SequenceBlocks
from vlora.metrics import EngineMetrics
from vlora.engine.sampler import make_seed
from vlora.engine.sequence import Sequence
from vlora.orchestrator.orchestrator import Orchestrator
from vlora.orchestrator.policies import UNMERGE, Candidate, Decision


@dataclass
class ScheduledBatch:
    """What :meth:`Scheduler.schedule` decided for one step."""

    batch: list[Sequence] = field(default_factory=list)  # ordered by adapter slot
    admitted: list[Sequence] = field(default_factory=list)  # waiting requests admitted by this call
    failed: list[tuple[Sequence, str]] = field(default_factory=list)  # (request, why it can never run)


class Scheduler:
    """Admission, the token budget and the orchestrator's decision (see the module docstring).

    ``kv`` is the runner's paged KV cache (``blocks_for``, ``num_blocks``, ``block_size``, ``allocator``),
    ``loras`` the LoraManager (``try_acquire``, ``release``, ``slot_identity``), ``loaded`` the loaded
    model (its family finds the image placeholders that prefix hashes cover)."""

    def __init__(self, config: EngineConfig, kv, loras, orchestrator: Orchestrator, loaded,
                 metrics: EngineMetrics, max_model_len: int) -> None:
        self.config = config
        self.kv = kv
        self.loras = loras
        self.orchestrator = orchestrator
        self.loaded = loaded
        self.metrics = metrics
        self.max_model_len = max_model_len
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.prefix_stats = {"queried_tokens": 0, "reused_tokens": 0, "evictions": 0}  # cache.prefix_caching

    def add(self, req: PreparedRequest, callback) -> Sequence:
        """Queue a prepared request; returns its sequence."""
        max_len = min(self.max_model_len, len(req.prompt_ids) + (1 if req.task else req.sampling.max_tokens))
        seq = Sequence(req=req, callback=callback, max_len=max_len, seed=make_seed(req.sampling))
        orch = self.orchestrator
        seq.candidate = Candidate(req.request_id, req.lora_name, orch.clock(),
                                  orch.latency_target(req.lora_name, req.latency_target),
                                  remaining=max_len - len(req.prompt_ids))
        self.waiting.append(seq)
        return seq

    def remove(self, s: Sequence) -> None:
        """Forget ``s`` (it finished): out of the running batch or the waiting queue."""
        if s in self.running:
            self.running.remove(s)
        elif s in self.waiting:
            self.waiting.remove(s)

    def schedule(self) -> ScheduledBatch:
        """The next step's batch: ask the policy for the batch and mode, switch, then admit what fits."""
        out = ScheduledBatch()
        cands = [s for s in self.running if s.schedulable] + list(self.waiting)
        if not cands:
            return out
        orch = self.orchestrator
        decision = orch.decide([s.candidate for s in cands])
        if not orch.enter(decision.mode, decision.merged):  # the adapter to merge found no free slot
            decision = self._fifo_unmerged(cands)
        batch = self._fill(decision.batch, cands, out)
        if not batch and orch.mode != UNMERGE:  # nothing of that mode fits now: make progress unmerged
            decision = self._fifo_unmerged(cands)
            batch = self._fill(decision.batch, cands, out)
        orch.mode_impl.check([s.slot for s in batch], orch.merged_slot)
        out.batch = sorted(batch, key=lambda s: orch.lora_slots(s.slot))
        return out

    def _fifo_unmerged(self, cands: list[Sequence]) -> Decision:
        self.orchestrator.enter(UNMERGE, None)
        return Decision(UNMERGE, None, sorted((s.candidate for s in cands), key=lambda c: c.last_served))

    def _fill(self, picked, cands: list[Sequence], out: ScheduledBatch) -> list[Sequence]:
        if self.config.scheduler.chunked_prefill:
            return self._fill_chunked(picked, cands, out)
        sch = self.config.scheduler
        by_id = {s.req.request_id: s for s in cands}
        budget = sch.max_num_batched_tokens
        batch: list[Sequence] = []
        for c in picked:
            if len(batch) >= sch.max_batch_size:
                break
            s = by_id.get(c.request_id)
            if s is None or s.finished:  # failed at admission earlier in this call
                continue
            n = s.step_tokens
            if s not in self.running:
                # A waiting prompt is charged what it will run: its length less the cached prefix that
                # admission finds. Without the prefix cache that is its whole length, known now.
                if n > budget and batch and not self.config.cache.prefix_caching:
                    continue
                if not self._admit_one(s, out):
                    continue
                out.admitted.append(s)
                n = s.step_tokens
                if n > budget and batch:
                    continue  # admitted (its blocks and slot held): it runs in a later step
            elif n > budget and batch:
                continue  # a prompt larger than the whole budget still runs, alone
            s.chunk = 0 if s.prefilled else n
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
            s.chunk = 0 if s.prefilled else n
            batch.append(s)
            budget -= n
        return batch

    def _fill_chunked(self, picked, cands: list[Sequence], out: ScheduledBatch) -> list[Sequence]:
        """Sarathi's batch: the decodes first, one token each (the policy's picks, then the running requests the
        mode serves), then the prompts, each a chunk of the budget left (``Sequence.chunk``): those already
        running (mid-prefill) before those admitted now, each in the policy's order. A prompt longer than what
        is left runs its first chunk now and the rest in later steps, beside the decodes of those steps."""
        sch = self.config.scheduler
        by_id = {s.req.request_id: s for s in cands}
        orch = self.orchestrator
        picks = [by_id[c.request_id] for c in picked if c.request_id in by_id]
        served = [s for s in sorted(self.running, key=lambda s: s.candidate.last_served)
                  if s.schedulable and orch.mode_impl.accepts(s.slot, orch.merged_slot)]
        budget = sch.max_num_batched_tokens
        batch: list[Sequence] = []
        taken: set[int] = set()

        def take(s: Sequence, n: int) -> None:
            s.chunk = 0 if s.prefilled else n
            batch.append(s)
            taken.add(id(s))

        for s in picks + served:  # decodes
            if len(batch) >= sch.max_batch_size or budget <= 0:
                break
            if s.prefilled and id(s) not in taken and not s.finished:
                take(s, 1)
                budget -= 1
        running = [s for s in picks + served if s in self.running]
        waiting = [s for s in picks if s not in self.running]
        for s in running + waiting:  # prompts, a chunk each
            if len(batch) >= sch.max_batch_size or budget <= 0:
                break
            if s.prefilled or s.finished or id(s) in taken:  # finished: failed at admission earlier in this call
                continue
            if s not in self.running:
                if not self._admit_one(s, out):
                    continue
                out.admitted.append(s)
            n = min(s.step_tokens, budget)
            take(s, n)
            budget -= n
        return batch

    def _admit_one(self, s: Sequence, out: ScheduledBatch) -> bool:
        """Reserve KV blocks and pin an adapter slot for a waiting request; False: it waits (or, when it can
        never run, it is out of the queue and in ``out.failed``)."""
        if len(self.running) >= self.config.scheduler.max_batch_size:
            return False
        need = self.kv.blocks_for(s.max_len)
        if need > self.kv.num_blocks:
            self._fail(s, f"request needs {need} KV blocks, the cache has {self.kv.num_blocks}", out)
            return False
        try:
            # Asked before the KV check so that a load starts (and overlaps) even while the cache is full.
            slot = self.loras.try_acquire(s.req.lora_name)
        except InvalidRequest as e:  # unloaded, or its folder broke since the request was validated
            self._fail(s, str(e), out)
            return False
        if slot is None:
            return False  # its adapter is being read or copied, or every slot is pinned: a later step
        alloc = self.kv.allocator
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
        s.cached_tokens = s.computed = len(hit) * self.kv.block_size
        stats = self.prefix_stats
        stats["queried_tokens"] += len(s.req.prompt_ids)
        stats["reused_tokens"] += s.cached_tokens
        evicted = alloc.evictions - stats["evictions"]
        stats["evictions"] = alloc.evictions
        self.metrics.prefix_cache(len(s.req.prompt_ids), s.cached_tokens, evicted)
        self.running.append(s)
        s.candidate.running = True
        return True

    def _fail(self, s: Sequence, error: str, out: ScheduledBatch) -> None:
        self.waiting.remove(s)
        s.finished = True  # answered by the engine from out.failed; never picked again
        out.failed.append((s, error))

    def _prefix_hashes(self, s: Sequence, identity: str) -> list[bytes]:
        """Chained hashes of the prompt's full blocks, leaving at least one token to run (its logits).

        Block i's hash covers the weights that made the KV (``identity``: the adapter's name and version, "" for the
        base model), blocks 0..i's token ids, and the content hashes of the images (or video) whose
        placeholder tokens start in blocks 0..i: a block is shared only by requests that would have
        computed the same keys and values."""
        bs = self.kv.block_size
        ids = s.req.prompt_ids
        n_full = (len(ids) - 1) // bs
        if n_full <= 0:
            return []
        starts: dict[int, list[bytes]] = {}  # block -> keys of the images starting there
        req = s.req
        if req.pixel_values is not None and len(req.image_keys):
            loaded = self.loaded
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
