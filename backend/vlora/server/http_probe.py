"""The launcher's HTTP probes of the processes it starts: the status a GET gets (tritonserver's restricted APIs,
the OpenAI front end's /health; sent directly, never through a *_proxy) and whether it gets 200 (readiness)."""
from __future__ import annotations

import urllib.error
import urllib.request
from typing import Optional


def http_status(url: str, headers: Optional[dict] = None) -> Optional[int]:
    """The HTTP status of a GET of ``url`` (sent directly, never through a *_proxy), None when unreachable."""
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    try:
        with opener.open(urllib.request.Request(url, headers=headers or {}), timeout=5) as resp:
            return resp.status
    except urllib.error.HTTPError as e:
        return e.code
    except (urllib.error.URLError, OSError):
        return None


def http_ok(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=2) as resp:
            return resp.status == 200
    except (urllib.error.URLError, OSError):
        return False
