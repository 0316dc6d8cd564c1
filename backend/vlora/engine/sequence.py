"""A request's state inside the engine: its tokens, KV blocks, adapter slot, text and what the scheduling
policy sees of it. Shared by the scheduler (admission, the batch) and the loop (stepping, reporting)."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from vlora.engine.api import OutputCallback, PreparedRequest
from vlora.engine.kv_cache import SequenceBlocks
from vlora.orchestrator.policies import Candidate


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
    # Chunked prefill: ``computed`` prompt tokens have their KV in the cache or written by a launched step (the
    # cached prefix from admission, then each chunk as it is launched; the engine writes it), and the next step
    # runs ``chunk`` more (the scheduler writes it each step). ``prefilled`` once ``computed`` reaches the prompt.
    computed: int = 0
    chunk: int = 0
    # The encoded features of this request's images whose placeholders run on into a later chunk, by encoder
    # item (the runner writes it while a prefill is chunked; None otherwise): each image is encoded once.
    held_features: Optional[dict] = None
    placeholder_marks: Optional[list] = None  # positions of the prompt's image placeholders, found once

    @property
    def step_tokens(self) -> int:
        """Tokens this request still has to run before its next token: the prompt past what is computed (its
        cached prefix and the chunks run), then one at a time."""
        return 1 if self.prefilled else len(self.req.prompt_ids) - self.computed
