"""benchmarks/server_overhead.py's parts that need no server: the banner's URLs and a point's figures (the whole
script ran on the tiny model by hand: `python -m benchmarks.server_overhead --concurrency 1,4 --rounds 1`)."""
from __future__ import annotations

import pytest

from benchmarks.server_overhead import _figures, banner_urls, prompt


def test_banner_urls_are_read_from_vlora_serves_banner():
    from vlora.config import EngineConfig
    from vlora.server.banner import serving_banner
    from vlora.server.options import ServeOptions

    text = serving_banner(ServeOptions(), EngineConfig(), None, None, "http://127.0.0.1:18000", "127.0.0.1:18001",
                          "http://127.0.0.1:18002/metrics", None, None)
    assert banner_urls(text) == {"HTTP": "127.0.0.1:18000", "metrics": "http://127.0.0.1:18002/metrics"}
    with pytest.raises(RuntimeError, match="banner"):
        banner_urls("nothing here")


def test_figures_and_prompts():
    f = _figures([(0.010, 0.110, 11), (0.020, 0.220, 11), (0.030, 0.030, 1)], seconds=1.0)
    assert f["requests"] == 3 and f["ttft_ms_p50"] == 20.0 and f["output_tok_per_s"] == 23.0
    assert f["per_token_ms_p50"] == pytest.approx(15.0)  # 10 and 20 ms per token; the 1-token request has none
    assert prompt(1) != prompt(2) and prompt(1) == prompt(1)
