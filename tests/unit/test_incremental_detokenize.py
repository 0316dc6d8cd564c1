"""Incremental detokenization (OutputProcessor.decode_delta) gives the text a full decode gives, token by
token, with the tiny model's byte-level tokenizer: multi-byte characters split over byte tokens,
special tokens and invalid byte sequences included."""
from __future__ import annotations

import random

import pytest

from vlora.engine.output import OutputProcessor
from vlora.engine.sequence import Sequence


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(tiny_model_dir))


def _byte_token_ids(tokenizer) -> dict[int, int]:
    """Byte value -> the id of the byte-level BPE token for that single byte (GPT-2's byte alphabet)."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    chars, n = {}, 0
    for b in range(256):
        if b in printable:
            chars[b] = chr(b)
        else:
            chars[b] = chr(256 + n)
            n += 1
    return {b: tokenizer.convert_tokens_to_ids(c) for b, c in chars.items()}


def _full(tokenizer, ids):
    return tokenizer.decode(ids, skip_special_tokens=True)


def _check_incremental(tokenizer, ids):
    engine = OutputProcessor(tokenizer, set())
    seq = Sequence(req=None, callback=None, max_len=len(ids))
    for n, tok in enumerate(ids, 1):
        seq.output_ids.append(tok)
        seq.text += engine.decode_delta(seq)
        full = _full(tokenizer, ids[:n])
        assert full.startswith(seq.text), (ids[:n], seq.text, full)
        if not full.endswith("\ufffd"):
            assert seq.text == full, (ids[:n], seq.text, full)
        assert seq.prefix_offset <= seq.read_offset <= n
    seq.text += engine.decode_delta(seq, final=True)
    assert seq.text == _full(tokenizer, ids)


def test_unicode_text_split_into_bytes(tokenizer):
    byte_ids = _byte_token_ids(tokenizer)
    assert all(isinstance(i, int) and i != tokenizer.unk_token_id for i in byte_ids.values())
    text = "naïve € 😀 ok, 日本語 — ça marche 🎉!"
    as_bytes = [byte_ids[b] for b in text.encode("utf-8")]
    assert _full(tokenizer, as_bytes) == text
    _check_incremental(tokenizer, as_bytes)
    _check_incremental(tokenizer, tokenizer.encode(text, add_special_tokens=False))


@pytest.mark.parametrize("seed", range(20))
def test_random_token_sequences(tokenizer, seed):
    rng = random.Random(seed)
    byte_ids = list(_byte_token_ids(tokenizer).values())
    high_bytes = [i for b, i in _byte_token_ids(tokenizer).items() if b >= 0x80]
    vocab = len(tokenizer)
    ids = []
    for _ in range(rng.randrange(1, 120)):
        r = rng.random()
        ids.append(rng.choice(high_bytes) if r < 0.4 else rng.choice(byte_ids) if r < 0.6 else rng.randrange(vocab))
    _check_incremental(tokenizer, ids)


def test_pending_bytes_wait_and_then_complete(tokenizer):
    byte_ids = _byte_token_ids(tokenizer)
    euro = [byte_ids[b] for b in "€".encode()]
    engine = OutputProcessor(tokenizer, set())
    seq = Sequence(req=None, callback=None, max_len=8)
    deltas = []
    for tok in [byte_ids[ord("a")]] + euro + [byte_ids[ord("b")]]:
        seq.output_ids.append(tok)
        deltas.append(engine.decode_delta(seq))
    assert deltas == ["a", "", "", "€", "b"]
    assert (seq.prefix_offset, seq.read_offset) == (4, 5)  # the window is one token back, not the whole text


def test_stray_byte_tokens_still_stream(tokenizer):
    """A model that keeps emitting lead bytes never completes a character: every replacement character
    but the last (which a next byte could still complete) goes out as it is generated."""
    lead = _byte_token_ids(tokenizer)[0xE2]
    engine = OutputProcessor(tokenizer, set())
    seq = Sequence(req=None, callback=None, max_len=64)
    for n in range(1, 41):
        seq.output_ids.append(lead)
        seq.text += engine.decode_delta(seq)
        assert seq.text == "\ufffd" * (n - 1)
    seq.text += engine.decode_delta(seq, final=True)
    assert seq.text == _full(tokenizer, seq.output_ids)
