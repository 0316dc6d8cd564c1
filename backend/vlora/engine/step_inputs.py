"""What one engine step feeds the model runner: a :class:`SeqInput` per scheduled sequence, in batch order.

A decode sequence gives its one new token (or, with the step overlap, the row of the previous step's
sampled ids where that token still is on the device). A prompt gives its next chunk past what is computed
(``Sequence.computed``, ``Sequence.chunk``: see :mod:`vlora.engine.scheduler` on chunked prefill) with its
images; a chunk that ends before the prompt's end says how many image placeholders lie before it and carries
the request's held features, so that an image whose placeholders straddle two chunks is encoded once.
"""
from __future__ import annotations

import bisect
import time

from vlora.engine.model_runner import SeqInput
from vlora.engine.sequence import Sequence


def step_inputs(batch: list[Sequence], orchestrator, loras, loaded, metrics) -> list[SeqInput]:
    """The runner's inputs for ``batch``; a prompt's first chunk reports its stage timers (queue and the
    image path's) to ``metrics``. ``orchestrator`` maps slots to the mode's LoRA slots, ``loras`` gives the
    vision side's slot, ``loaded`` the family that knows the image placeholder."""
    now = time.monotonic()
    inputs = []
    for s in batch:
        plus, minus = orchestrator.lora_slots(s.slot)
        req = s.req
        if s.prefilled:
            token, row = (0, s.inflight_row) if s.inflight else (s.output_ids[-1], -1)
            inputs.append(SeqInput([token], s.num_tokens - 1, s.blocks, plus, delora_slot=minus,
                                   rope_delta=req.rope_delta, pending_row=row))
            continue
        c, end = s.computed, s.computed + s.chunk
        if c == s.cached_tokens:  # its first chunk
            metrics.stage("queue", now - req.arrival)
            for name, seconds in req.timings.items():
                metrics.stage(name, seconds)
        # The vision side is never merged: the images go through the adapter's own slot, whatever the mode.
        vision_slot, vision_identity = loras.vision_side(s.slot)
        before = None
        if req.pixel_values is not None and len(req.pixel_values) and end < len(req.prompt_ids):
            before = placeholders_before(s, loaded, c)
            if s.held_features is None:
                s.held_features = {}
        inputs.append(SeqInput(req.prompt_ids[c:end], c, s.blocks, plus, delora_slot=minus,
                               pixel_values=req.pixel_values, image_keys=req.image_keys,
                               image_grid_thw=req.image_grid_thw, mrope_positions=req.mrope_positions,
                               rope_delta=req.rope_delta, video=req.video, vision_slot=vision_slot,
                               vision_identity=vision_identity, placeholders_before=before,
                               held_features=s.held_features))
    return inputs


def placeholders_before(s: Sequence, loaded, pos: int) -> int:
    """How many of ``s``'s image placeholder tokens lie before prompt position ``pos`` (a chunk's start):
    the runner places the features that follow them."""
    if s.placeholder_marks is None:
        marker = loaded.family.placeholder_id(loaded, s.req.video)
        s.placeholder_marks = [i for i, t in enumerate(s.req.prompt_ids) if t == marker]
    return bisect.bisect_left(s.placeholder_marks, pos)
