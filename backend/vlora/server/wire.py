"""The Triton vLLM backend's wire format, as the Triton model (model_repository/vlora/1/model.py) speaks it.

Inputs text_input, image (base64, one or more), stream, sampling_parameters (JSON), exclude_input_in_output;
lora_name and the sampling options in the request parameters or in sampling_parameters (the latter wins).
Outputs text_output, finish_reason, num_input_tokens, num_output_tokens; a task head's answer adds label,
scores and label_names. Errors go back as a TritonError: INVALID_ARG for a bad request, UNAVAILABLE for a
server that cannot take it now, CANCELLED for a request its client cancelled.

Everything here goes through the ``pb_utils`` module a :class:`Wire` is given: Triton's
``triton_python_backend_utils`` in the stub (importable only there), a small fake in the unit tests.
"""
from __future__ import annotations

import json
import traceback
from dataclasses import dataclass
from typing import Any, Optional

import numpy as np

from vlora.engine.api import GenerationOutput, GenerationRequest, SamplingParams, parse_sampling_json
from vlora.errors import InvalidRequest

# Request parameters that are not sampling options; accepted and ignored (clients of the vLLM
# backend send "stream" there, and the input tensor decides).
IGNORED_PARAMETERS = ("stream",)
SAMPLING_KEYS = SamplingParams.KEYS + SamplingParams.EXTRA_KEYS
ADMIN_KEY = "adapter_action"  # vlora.server.admin answers these requests
ADMIN_TOKEN_KEY = "admin_token"  # load/unload carry it; checked against lora.admin_token_file's token
# Tests only: a request parameter that injects a fault into the engine (accepted when the engine
# setting scheduler.fault_injection is on; see vlora.engine.async_engine.FAULTS).
FAULT_KEY = "vlora_test_fault"


@dataclass(frozen=True)
class ParsedRequest:
    """A generation request as it came off the wire, before the engine checks it."""

    gen: GenerationRequest
    exclude_input: bool  # exclude_input_in_output (default true): a non-streaming answer without the prompt
    fault: Optional[str]  # FAULT_KEY's value, for the engine's fault injection (tests only)


class Wire:
    """Requests in and responses out, through one ``pb_utils`` module."""

    def __init__(self, pb_utils: Any) -> None:
        self.pb = pb_utils

    # Requests.
    def single(self, request, name: str):
        """The first element of an optional input tensor, or None when the client did not send it."""
        tensor = self.pb.get_input_tensor_by_name(request, name)
        if tensor is None:
            return None
        values = tensor.as_numpy().reshape(-1)
        if values.size == 0:
            return None
        value = values[0]
        return value.item() if isinstance(value, np.generic) else value

    def options(self, request) -> dict[str, Any]:
        """Request parameters first, then the sampling_parameters input over them. Raises InvalidRequest."""
        options = request_parameters(request)
        options.update(parse_sampling_json(self.single(request, "sampling_parameters")))
        return options

    def parse(self, request, request_id: str, *, fault_injection: bool) -> ParsedRequest:
        """Triton tensors and parameters -> GenerationRequest. Raises InvalidRequest naming the problem."""
        text = self.single(request, "text_input")
        if text is None:
            raise InvalidRequest("text_input is required")
        try:
            prompt = text.decode("utf-8") if isinstance(text, bytes) else str(text)
        except UnicodeDecodeError:
            raise InvalidRequest("text_input is not valid UTF-8") from None

        # Base64 as sent (the vLLM backend's convention); engine.prepare decodes and checks them.
        tensor = self.pb.get_input_tensor_by_name(request, "image")
        images = [bytes(item) for item in tensor.as_numpy().reshape(-1)] if tensor is not None else []

        stream = bool(self.single(request, "stream") or False)
        exclude = self.single(request, "exclude_input_in_output")
        exclude_input = True if exclude is None else bool(exclude)

        options = self.options(request)
        fault = options.pop(FAULT_KEY, None)
        if fault is not None and not fault_injection:
            raise InvalidRequest(f"unknown request parameter(s) {[FAULT_KEY]}; accepted: {sorted(SAMPLING_KEYS + (ADMIN_KEY,))}")
        extras = {k: options.pop(k) for k in SamplingParams.EXTRA_KEYS if k in options}
        sampling = SamplingParams.from_dict(options)
        lora_name = extras.get("lora_name")
        if lora_name is not None and not isinstance(lora_name, str):
            raise InvalidRequest(f"lora_name must be a string, got {lora_name!r}")
        apply_chat_template = extras.get("apply_chat_template", False)
        if not isinstance(apply_chat_template, bool):
            raise InvalidRequest("apply_chat_template must be true or false")
        task = extras.get("task")
        if task is not None and not isinstance(task, str):
            raise InvalidRequest("task must be a string")
        gen = GenerationRequest(
            request_id=request_id,
            prompt=prompt,
            images=images,
            lora_name=lora_name or None,
            sampling=sampling,
            stream=stream,
            apply_chat_template=apply_chat_template,
            task=task,
        )
        return ParsedRequest(gen, exclude_input, fault)

    # Responses.
    def string_tensor(self, name: str, text: str):
        return self.pb.Tensor(name, np.array([text.encode("utf-8")], dtype=np.object_))

    def count_tensor(self, name: str, value: int):
        return self.pb.Tensor(name, np.array([value], dtype=np.uint32))

    def head_tensors(self, answer: dict[str, Any]) -> list:
        """``label``, ``scores`` (one per label, softmax) and ``label_names`` (in the same order)."""
        return [
            self.string_tensor("label", answer["label"]),
            self.pb.Tensor("scores", np.asarray(answer["scores"], dtype=np.float32)),
            self.pb.Tensor("label_names", np.array([x.encode("utf-8") for x in answer["labels"]], dtype=np.object_)),
        ]

    def output_tensors(self, out: GenerationOutput, *, stream: bool, prefix: str, sent_output_tokens: int) -> Optional[list]:
        """The tensors of the response to one engine event, or None when it sends nothing (a streaming event
        without new text, or an unfinished event of a non-streaming request). A streamed response counts the
        tokens since ``sent_output_tokens``; a non-streaming one gets ``prefix`` (the prompt, when
        exclude_input_in_output is false) before its text. A finished one ends with finish_reason, and a
        task head's answer with its label and scores."""
        if stream:
            if not out.finished and not out.text_delta:
                return None
            tensors = [
                self.string_tensor("text_output", out.text_delta),
                self.count_tensor("num_input_tokens", out.num_input_tokens),
                self.count_tensor("num_output_tokens", max(out.num_output_tokens - sent_output_tokens, 0)),
            ]
        elif out.finished:
            tensors = [
                self.string_tensor("text_output", prefix + out.text),
                self.count_tensor("num_input_tokens", out.num_input_tokens),
                self.count_tensor("num_output_tokens", out.num_output_tokens),
            ]
        else:
            return None
        if out.finished:
            tensors.append(self.string_tensor("finish_reason", out.finish_reason or "stop"))
            if "label" in out.extra:  # a task head's answer
                tensors += self.head_tensors(out.extra)
        return tensors

    def send_final(self, sender, tensors: list) -> None:
        sender.send(self.pb.InferenceResponse(output_tensors=tensors), flags=self.pb.TRITONSERVER_RESPONSE_COMPLETE_FINAL)

    def send_error(self, sender, message: str, unavailable: bool = False) -> None:
        """Answer with a TritonError: INVALID_ARG, or UNAVAILABLE when the server (not the request) is the cause."""
        self._send_error(sender, message, "UNAVAILABLE" if unavailable else "INVALID_ARG", self.pb.Logger.log_error, "an error")

    def send_cancelled(self, sender) -> None:
        self._send_error(sender, "request cancelled", "CANCELLED", self.pb.Logger.log_warn, "a cancellation")

    def _send_error(self, sender, message: str, code_name: str, log, what: str) -> None:
        code = getattr(self.pb.TritonError, code_name, None)  # older Triton releases lack some codes
        error = self.pb.TritonError(message) if code is None else self.pb.TritonError(message, code)
        try:
            sender.send(self.pb.InferenceResponse(error=error), flags=self.pb.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
        except Exception:
            log(f"vlora: sending {what} failed: {traceback.format_exc()}")


def request_parameters(request) -> dict[str, Any]:
    """Request parameters (JSON keys of /generate that are not inputs, or gRPC parameters)."""
    raw = request.parameters()
    params = json.loads(raw) if raw else {}
    for key in IGNORED_PARAMETERS:
        params.pop(key, None)
    unknown = sorted(set(params) - set(SAMPLING_KEYS) - {ADMIN_KEY, ADMIN_TOKEN_KEY, FAULT_KEY})
    if unknown:
        raise InvalidRequest(
            f"unknown request parameter(s) {unknown}; accepted: {sorted(SAMPLING_KEYS + (ADMIN_KEY,))}"
        )
    return params
