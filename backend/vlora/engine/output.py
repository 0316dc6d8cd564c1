"""From sampled tokens to what a client sees: incremental detokenization and stop conditions.

:class:`OutputProcessor` extends a sequence's text by the tokens it just got, decoding only the last few
tokens (vLLM's incremental detokenizer), and decides whether the request ends: an end-of-sequence token
(unless ``ignore_eos``), ``max_tokens``, the context, or a stop string (cut from the text). A streaming
request gets an event for each piece of new text, holding back as many characters as the longest stop
string could still need.
"""
from __future__ import annotations

from typing import Optional

from vlora.engine.api import GenerationOutput
from vlora.engine.sequence import Sequence


class OutputProcessor:
    def __init__(self, tokenizer, eos_ids: set[int]) -> None:
        self.tokenizer = tokenizer
        self.eos_ids = eos_ids
        self._decode = fast_decode(tokenizer)

    def advance(self, s: Sequence, tok: int) -> tuple[Optional[str], Optional[GenerationOutput]]:
        """Take the token ``tok`` just appended to ``s.output_ids``: extend ``s.text`` and decide whether the
        request ends. Returns (finish reason or None, a streaming event to send or None)."""
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
        text = s.text + self.decode_delta(s, final=reason is not None)
        if sp.stop:
            # The text only grows, and an earlier match would have stopped the request already: only
            # matches that reach into the new text are looked for.
            found = (text.find(x, max(0, old_len - len(x) + 1)) for x in sp.stop)
            cut = min((i for i in found if i >= 0), default=-1)
            if cut >= 0:
                text, reason = text[:cut], "stop"
        s.text = text
        if reason is not None or not s.req.stream:
            return reason, None
        hold = max((len(x) for x in sp.stop), default=1) - 1
        upto = len(text) - hold  # text never ends in an incomplete character: decode_delta waits
        if upto <= s.sent:
            return None, None
        event = GenerationOutput(s.req.request_id, text[s.sent:upto], text[:upto], False,
                                 num_input_tokens=len(s.req.prompt_ids), num_output_tokens=len(s.output_ids))
        s.sent = upto
        return None, event

    def decode_delta(self, s: Sequence, final: bool = False) -> str:
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


def fast_decode(tokenizer):
    """``ids -> text`` as ``tokenizer.decode(ids, skip_special_tokens=True)``. A fast tokenizer without
    clean-up is called directly on its Rust backend, skipping the wrapper's argument conversions (five
    times the decode itself, per token of every request)."""
    backend = getattr(tokenizer, "_tokenizer", None)
    if backend is not None and hasattr(backend, "decode") and not getattr(tokenizer, "clean_up_tokenization_spaces", True):
        return lambda ids: backend.decode(ids, skip_special_tokens=True)
    return lambda ids: tokenizer.decode(ids, skip_special_tokens=True)
