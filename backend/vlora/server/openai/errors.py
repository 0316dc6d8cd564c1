"""OpenAI's error shape for the front end, and the mapping from the model's (or Triton's) errors to it.

``APIError`` is an answer in ``{"error": {"message", "type", "param", "code"}}`` with its HTTP status;
``error_from_triton`` reads the model's ``[CODE]`` prefixes (``[INVALID_ARG]`` 400, or 404 ``model_not_found`` for
an unknown adapter; ``[UNAVAILABLE]`` and Triton's full queue 503; ``[INTERNAL]`` 500), never passing on a traceback.
"""
from __future__ import annotations

import re
from typing import Optional

MAX_ERROR_CHARS = 2000

_CODE_PREFIX = re.compile(r"^\[([A-Z_]+)\] ")
_TRITON_UNAVAILABLE = ("Exceeds maximum queue size", "Request timeout expired")


class APIError(Exception):
    """An answer in OpenAI's error shape."""

    def __init__(self, status: int, message: str, type_: str = "invalid_request_error",
                 param: Optional[str] = None, code: Optional[str] = None) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type_, param, code

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def bad_request(message: str, param: Optional[str] = None, code: Optional[str] = None) -> APIError:
    return APIError(400, message, "invalid_request_error", param, code)


def error_from_triton(message: str, model: Optional[str] = None) -> APIError:
    """The model's (or Triton's) error message -> the OpenAI error with the matching status."""
    message = (message or "").split("\n\nAt:")[0][:MAX_ERROR_CHARS]  # never a Python traceback
    m = _CODE_PREFIX.match(message)
    code, text = (m.group(1), message[m.end():]) if m else (None, message)
    if code == "INVALID_ARG":
        if text.startswith("unknown adapter"):
            return APIError(404, f"The model '{model}' does not exist: {text}", "invalid_request_error", "model",
                            "model_not_found")
        pm = re.match(r"(max_tokens|temperature|top_p|seed|stop|latency_target|task|ignore_eos|messages)\b", text)
        if pm is None and text.startswith(("too many images", "image ", "images:")):
            return bad_request(text, "messages")  # the images of a chat are its image_url parts
        return bad_request(text, pm.group(1) if pm else None)
    if code == "UNAVAILABLE" or any(s in text for s in _TRITON_UNAVAILABLE):
        return APIError(503, text, "server_error", None, "service_unavailable")
    if code == "CANCELLED":
        return APIError(503, text, "server_error", None, "cancelled")
    if code == "INTERNAL":
        return APIError(500, text, "server_error", None, "internal_error")
    return APIError(500, text or "the inference server failed the request", "server_error", None, "internal_error")
