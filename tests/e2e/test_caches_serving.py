"""The encoder cache and the prefix KV cache through the real server (issue 23): `vlora serve` on the CPU
with both caches on, the tiny LLaVA model, a language-only adapter and two vision-side adapters.

The workload is the one the caches are for:
- a video-analytics stream: four applications (two vision-side adapters, a language-only adapter and the
  base model) ask about the same frames, then about the next frames (one frame in common);
- retrieval: questions that share a long system prompt, for the base model and an adapter.

Greedy answers are the same one at a time (the caches filling up) and all at once (everything cached),
and the same as an engine in this process with both caches off. Triton's metrics endpoint shows encoder
cache hits and prefix-cache reuse. An adapter reloaded with new weights under its name answers as a fresh
engine on the new weights does: neither cache serves the old version's features or KV.
"""
from __future__ import annotations

import re
import shutil
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Optional

import pytest

from e2e_helpers import png_bytes, start_server
from vlora_client import VloraClient

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(600)]  # a safety net: nothing here may hang CI

pytest.importorskip("peft")  # the vision-side adapters are written by PEFT

LANGUAGE_ONLY = "demo-r8-qv"
MAX_TOKENS = 5
FRAMES = [png_bytes(60 + i) for i in range(3)]
SYSTEM = ("USER: You answer questions about the city's traffic reports. Reports: the north bridge is closed "
          "for repairs until Friday; buses take the east road; the tram runs every ten minutes. ")


def _apps() -> dict[Optional[str], str]:
    """Adapter (None: the base model) -> its application's question."""
    from vlora.models.tiny import VISION_ADAPTER_NAMES

    v8, v16 = VISION_ADAPTER_NAMES
    return {v8: "How many cars are there?", v16: "Is anyone crossing?", LANGUAGE_ONLY: "What is the weather?",
            None: "What changed?"}


def _cases() -> list[tuple[str, dict]]:
    """(case id, VloraClient.generate keyword arguments): the video stream, then the retrieval questions."""
    cases = []
    for t, frames in enumerate((FRAMES[0:2], FRAMES[1:3])):  # two frames per step of the stream
        for adapter, question in _apps().items():
            cases.append((f"video-t{t}-{adapter or 'base'}",
                          dict(prompt="USER: <image><image>\n" + question + " ASSISTANT:", images=frames,
                               lora_name=adapter)))
    for i, (adapter, question) in enumerate([(None, "Is the bridge open?"), (None, "How often is the tram?"),
                                             (LANGUAGE_ONLY, "Which road do buses take?"),
                                             (LANGUAGE_ONLY, "Is the bridge open?")]):
        cases.append((f"retrieval-{i}", dict(prompt=SYSTEM + question + " ASSISTANT:", images=[], lora_name=adapter)))
    for _, kw in cases:
        kw.update(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    return cases


CASES = _cases()


def metric_total(text: str, name: str) -> float:
    """The sum of every sample of ``name``."""
    return sum(float(m.group(1)) for m in re.finditer(rf"^{re.escape(name)}(?:\{{[^}}]*\}})?\s+(\S+)$", text, re.MULTILINE))


def cache_metrics(server) -> dict[str, float]:
    text = server.metrics()
    names = ("vlora_encoder_cache_hits_total", "vlora_encoder_cache_misses_total", "vlora_encoder_cache_bytes",
             "vlora_prefix_cache_prompt_tokens_total", "vlora_prefix_cache_reused_tokens_total")
    return {n.removeprefix("vlora_"): metric_total(text, n) for n in names}


def quiet_metrics(server) -> dict[str, float]:
    """The cache metrics once they stop changing (updates are applied on their own thread; every request
    sent has been answered when this is called), at most 10 s later."""
    deadline = time.monotonic() + 10
    last = cache_metrics(server)
    while time.monotonic() < deadline:
        time.sleep(0.3)
        now = cache_metrics(server)
        if now == last:
            break
        last = now
    return last


@pytest.fixture(scope="module")
def adapter_root(tmp_path_factory, tiny_model_dir, demo_adapter_root):
    from adapter_edit import mixed_vision_root

    return mixed_vision_root(tmp_path_factory.mktemp("cache-adapters"), tiny_model_dir, demo_adapter_root, LANGUAGE_ONLY)


@pytest.fixture(scope="module")
def cache_server(tmp_path_factory, vlora_cache, adapter_root):
    ws = tmp_path_factory.mktemp("e2e-cache-server")
    srv = start_server(ws, vlora_cache, extra_args=[
        "--adapters", str(adapter_root), "--set", "cache.prefix_caching=on", "--set", "cache.encoder_cache_mb=64"])
    assert srv.adapters == sorted(p.name for p in adapter_root.iterdir()), srv.launcher_output()[-3000:]
    yield srv
    code = srv.stop()
    assert code == 0, f"`vlora serve` did not stop cleanly (exit {code}):\n{srv.launcher_output()[-3000:]}"


def reference_engine(tiny_model_dir, adapter_root):
    """The engine in this process with both caches off: the answers the caches must not change."""
    from vlora.config import EngineConfig
    from vlora.engine.builder import build_engine

    return build_engine(EngineConfig().with_overrides({
        "model.path": str(tiny_model_dir), "lora.adapter_root": str(adapter_root), "model.device": "cpu",
        "model.dtype": "float32", "cache.prefix_caching": "off", "cache.encoder_cache_mb": "0"}))


def reference_texts(engine, cases) -> dict[str, str]:
    """The cases through ``engine``, greedy, batched (nothing is cached to share): case id -> text."""
    from vlora.engine.api import GenerationRequest, SamplingParams

    outs: dict[str, list] = {}
    for cid, kw in cases:
        outs[cid] = []
        req = GenerationRequest(cid, kw["prompt"], images=list(kw["images"]), lora_name=kw["lora_name"],
                                sampling=SamplingParams(max_tokens=kw["max_tokens"], ignore_eos=True))
        engine.add_request(engine.inputs.prepare(req), outs[cid].append)
    while engine.has_work():
        engine.step()
    assert all(out and out[-1].finish_reason == "length" for out in outs.values()), outs
    return {cid: out[-1].text for cid, out in outs.items()}


@pytest.fixture(scope="module")
def sequential(cache_server):
    """Each case alone over gRPC streaming, the caches filling up as they go."""
    client = VloraClient(cache_server.grpc_url)
    return {cid: client.generate(stream=True, **kw) for cid, kw in CASES}


def test_sequential_answers_fill_both_caches_and_hit_them(cache_server, sequential):
    for cid, result in sequential.items():
        assert result.finish_reason == "length" and result.num_output_tokens == MAX_TOKENS, (cid, result)
    texts = [sequential[cid].text for cid, _ in CASES if cid.startswith("video-t0")]
    assert len(set(texts)) > 1, f"the four applications answer alike: {texts}"
    m = quiet_metrics(cache_server)
    # t0 (frames 0, 1): each vision-side adapter encodes both with its own weights, the language-only adapter
    # through the plain encoder, and the base model finds those: 6 misses, 2 hits. t1 (frames 1, 2): each
    # finds frame 1 (4 hits); frame 2 is encoded once per vision-side weights (3 misses), the base model hits it.
    assert (m["encoder_cache_hits_total"], m["encoder_cache_misses_total"]) == (7, 9), m
    assert m["encoder_cache_bytes"] > 0, m
    # The second retrieval question of each adapter (base, language-only) reuses the system prompt's full
    # blocks; no video prompt shares a block with another (other adapter or other frames).
    assert m["prefix_cache_reused_tokens_total"] >= 2 * 2 * 16, m
    assert m["prefix_cache_prompt_tokens_total"] > m["prefix_cache_reused_tokens_total"], m


def test_concurrent_equals_sequential_and_hits_the_caches(cache_server, sequential):
    before = quiet_metrics(cache_server)
    client = VloraClient(cache_server.grpc_url)
    with ThreadPoolExecutor(len(CASES)) as pool:
        results = dict(zip([cid for cid, _ in CASES],
                           pool.map(lambda case: client.generate(stream=True, **case[1]), CASES)))
    for cid, ref in sequential.items():
        assert results[cid].text == ref.text, f"{cid}: concurrent {results[cid].text!r}, sequential {ref.text!r}"
    after = quiet_metrics(cache_server)
    # Nothing is encoded: a frame whose placeholders lie wholly inside a prompt's cached prefix is not even
    # looked up (its keys and values are in the prefix cache); the others are encoder-cache hits.
    n_images = sum(len(kw["images"]) for _, kw in CASES)
    assert 0 <= after["encoder_cache_hits_total"] - before["encoder_cache_hits_total"] <= n_images, (before, after)
    assert after["encoder_cache_misses_total"] == before["encoder_cache_misses_total"], (before, after)
    # Every prompt was asked before: each reuses its full blocks but the last one's (one token must run).
    assert after["prefix_cache_reused_tokens_total"] - before["prefix_cache_reused_tokens_total"] >= len(CASES) * 16, (before, after)


def test_answers_equal_an_engine_with_both_caches_off(tiny_model_dir, adapter_root, sequential):
    want = reference_texts(reference_engine(tiny_model_dir, adapter_root), CASES)
    assert {cid: r.text for cid, r in sequential.items()} == want


def test_a_reloaded_adapter_gets_neither_stale_features_nor_stale_kv(cache_server, sequential, adapter_root,
                                                                      tiny_model_dir, tmp_path):
    """Unload a vision-side adapter (which targets q/v too), replace its weights under the same name, load it:
    its answers about frames and prompts the caches hold for the old version are the new weights' answers."""
    from adapter_edit import clone_adapter
    from vlora.models.tiny import VISION_ADAPTER_NAMES

    name = VISION_ADAPTER_NAMES[0]
    mine = [(cid, kw) for cid, kw in CASES if kw["lora_name"] == name]
    admin = VloraClient(cache_server.grpc_url, admin_token=cache_server.admin_token)
    old = {cid: sequential[cid].text for cid, _ in mine}
    before = quiet_metrics(cache_server)
    assert {cid: admin.generate(stream=True, **kw).text for cid, kw in mine} == old  # the old version, cached
    cached = quiet_metrics(cache_server)
    # served from the caches: nothing encoded (frames inside a cached prefix are not even looked up)
    assert cached["encoder_cache_misses_total"] == before["encoder_cache_misses_total"], (before, cached)
    assert cached["encoder_cache_hits_total"] - before["encoder_cache_hits_total"] <= 4, (before, cached)
    assert cached["prefix_cache_reused_tokens_total"] > before["prefix_cache_reused_tokens_total"], (before, cached)

    admin.unload_adapter(name)
    clone_adapter(adapter_root, name, "new-weights", edit_tensors=lambda t: [v.mul_(-2.0) for k, v in t.items() if "lora_B" in k])
    shutil.rmtree(adapter_root / name)
    (adapter_root / "new-weights").rename(adapter_root / name)
    admin.load_adapter(name)
    new = {cid: admin.generate(stream=True, **kw).text for cid, kw in mine}
    local = tmp_path / "adapters"
    shutil.copytree(adapter_root / name, local / name)
    assert new == reference_texts(reference_engine(tiny_model_dir, local), mine)
    assert new != old, "the new weights do not change the answers: stale caches would not show"
    after = quiet_metrics(cache_server)
    # The new version encodes its frames anew (t0's two, t1's new one; t1's frame in common is then its
    # own hit) and reuses no KV block of the old one's.
    assert after["encoder_cache_misses_total"] - cached["encoder_cache_misses_total"] == 3, (cached, after)
    assert after["encoder_cache_hits_total"] - cached["encoder_cache_hits_total"] == 1, (cached, after)
    assert after["prefix_cache_reused_tokens_total"] == cached["prefix_cache_reused_tokens_total"], (cached, after)
