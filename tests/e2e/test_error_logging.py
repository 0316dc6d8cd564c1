"""Client errors do not spam the server log: each bad request leaves at most one log line and no traceback
(the issue saw a full traceback per request, 1.3 MB of log for 1,000 requests)."""
from __future__ import annotations

import json

import pytest

from e2e_helpers import MODEL, post_json
from test_errors import BAD_REQUESTS, GOOD_PROMPT

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(600)]  # a safety net: nothing here may hang CI

DEEP_JSON = '{"stop": ' + "[" * 100_000 + "]" * 100_000 + "}"  # nested far past any parser's recursion limit


def test_bad_requests_leave_at_most_one_log_line_each(server):
    url = f"{server.http_url}/v2/models/{MODEL}/generate"
    bodies = [body for _, body, _ in BAD_REQUESTS] + [
        {"text_input": GOOD_PROMPT, "sampling_parameters": DEEP_JSON},
        {"text_input": GOOD_PROMPT, "sampling_parameters": json.dumps({"max_tokens": "9" * 5000})},
        {"text_input": "", "adapter_action": "load", "lora_name": "x"},  # no admin token
    ]
    log_start = len(server.server_log(1_000_000).splitlines())
    for _ in range(3):
        for body in bodies:
            status, payload = post_json(url, body)
            assert status == 400 and payload.get("error"), (body, status, payload)
    status, payload = post_json(url, {"text_input": GOOD_PROMPT, "sampling_parameters": json.dumps({"max_tokens": 2})})
    assert status == 200, payload
    new = server.server_log(1_000_000).splitlines()[log_start:]
    assert not any("Traceback" in line for line in new), "\n".join(new[-40:])
    assert len(new) <= 3 * len(bodies), "\n".join(new[-40:])
