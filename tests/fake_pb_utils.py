"""A small stand-in for Triton's ``triton_python_backend_utils`` (importable only inside the Python backend's
stub), with what vlora.server's wire, admin and metrics modules use, so they are unit-tested on any machine.

``fake_pb_utils()`` returns a fresh module per test: its log (``Logger.lines``) and metric families
(``families``) start empty. Requests and senders are built with :class:`FakeRequest` and :class:`FakeSender`.
"""
from __future__ import annotations

import json
import types
from typing import Any, Optional

import numpy as np

COMPLETE_FINAL = 1  # TRITONSERVER_RESPONSE_COMPLETE_FINAL


class Tensor:
    def __init__(self, name: str, array: np.ndarray) -> None:
        self._name, self._array = name, array

    def name(self) -> str:
        return self._name

    def as_numpy(self) -> np.ndarray:
        return self._array


class TritonError:
    UNKNOWN, INTERNAL, NOT_FOUND, INVALID_ARG, UNAVAILABLE, UNSUPPORTED, ALREADY_EXISTS, CANCELLED = range(8)

    def __init__(self, message: str, code: int = 1) -> None:
        message.encode("utf-8")  # as pybind11 converts it to a C++ string: a lone surrogate raises here
        self._message, self._code = message, code

    def message(self) -> str:
        return self._message

    def code(self) -> int:
        return self._code


class InferenceResponse:
    def __init__(self, output_tensors: Optional[list] = None, error: Optional[TritonError] = None) -> None:
        self._tensors, self._error = list(output_tensors or []), error

    def output_tensors(self) -> list:
        return self._tensors

    def error(self) -> Optional[TritonError]:
        return self._error

    def has_error(self) -> bool:
        return self._error is not None

    def text(self, name: str) -> Any:
        """The first element of output ``name`` (decoded when it is bytes); a test helper, not Triton's API."""
        (tensor,) = [t for t in self._tensors if t.name() == name]
        value = tensor.as_numpy().reshape(-1)[0]
        return value.decode("utf-8") if isinstance(value, bytes) else value.item()


def get_input_tensor_by_name(request, name: str):
    for tensor in request.inputs():
        if tensor.name() == name:
            return tensor
    return None


class Metric:
    def __init__(self, family: "MetricFamily", labels: dict[str, str], buckets: Optional[list] = None) -> None:
        if family.kind == MetricFamily.HISTOGRAM and not buckets:
            raise ValueError("a histogram metric needs buckets")
        self.family, self.labels, self.buckets = family, dict(labels), buckets
        self._value = 0.0
        self.observations: list[float] = []

    def increment(self, value: float) -> None:
        if self.family.kind != MetricFamily.COUNTER and self.family.kind != MetricFamily.GAUGE:
            raise TypeError(f"{self.family.name}: increment on a histogram")
        if self.family.kind == MetricFamily.COUNTER and value < 0:
            raise ValueError(f"{self.family.name}: a counter cannot go down")
        self._value += value

    def set(self, value: float) -> None:
        if self.family.kind != MetricFamily.GAUGE:
            raise TypeError(f"{self.family.name}: set on a {self.family.kind}")
        self._value = value

    def observe(self, value: float) -> None:
        if self.family.kind != MetricFamily.HISTOGRAM:
            raise TypeError(f"{self.family.name}: observe on a {self.family.kind}")
        self.observations.append(value)

    def value(self) -> float:
        return self._value


class MetricFamily:
    COUNTER, GAUGE, HISTOGRAM = "counter", "gauge", "histogram"

    def __init__(self, name: str, description: str, kind: str) -> None:
        self.name, self.description, self.kind = name, description, kind
        self.metrics: list[Metric] = []

    def Metric(self, labels: dict[str, str], buckets: Optional[list] = None) -> Metric:  # noqa: N802 (Triton's name)
        metric = Metric(self, labels, buckets)
        self.metrics.append(metric)
        return metric

    def find(self, **labels: str) -> Metric:
        """The one metric of this family whose labels include ``labels``; a test helper."""
        (metric,) = [m for m in self.metrics if labels.items() <= m.labels.items()]
        return metric


class FakeSender:
    """A response sender that keeps what was sent, as (response, flags)."""

    def __init__(self, cancelled: bool = False, fail: bool = False) -> None:
        self.sent: list[tuple[InferenceResponse, int]] = []
        self.cancelled, self.fail = cancelled, fail

    def send(self, response: Optional[InferenceResponse] = None, flags: int = 0) -> None:
        if self.fail:
            raise RuntimeError("the client went away")
        self.sent.append((response, flags))

    def is_cancelled(self) -> bool:
        return self.cancelled

    @property
    def final(self) -> InferenceResponse:
        """The one response sent, which must carry the final flag."""
        ((response, flags),) = self.sent
        assert flags == COMPLETE_FINAL
        return response


class FakeRequest:
    """A request with string inputs (``text_input``, ``sampling_parameters``), other inputs as given, and
    request parameters (a dict, sent as Triton sends them: JSON)."""

    def __init__(self, inputs: Optional[dict[str, Any]] = None, parameters: Optional[dict[str, Any]] = None) -> None:
        self._inputs = [Tensor(name, _array(value)) for name, value in (inputs or {}).items()]
        self._parameters = json.dumps(parameters) if parameters else ""
        self.sender = FakeSender()

    def inputs(self) -> list[Tensor]:
        return self._inputs

    def parameters(self) -> str:
        return self._parameters

    def get_response_sender(self) -> FakeSender:
        return self.sender


def _array(value: Any) -> np.ndarray:
    if isinstance(value, np.ndarray):
        return value
    if isinstance(value, str):
        return np.array([value.encode("utf-8")], dtype=np.object_)
    if isinstance(value, (bytes, bytearray)):
        return np.array([bytes(value)], dtype=np.object_)
    if isinstance(value, bool):
        return np.array([value], dtype=np.bool_)
    if isinstance(value, list):
        return np.array([v.encode("utf-8") if isinstance(v, str) else v for v in value], dtype=np.object_)
    raise TypeError(f"no fake input for {value!r}")


class _Logger:
    def __init__(self) -> None:
        self.lines: list[tuple[str, str]] = []

    def log_info(self, message: str) -> None:
        self.lines.append(("info", message))

    def log_warn(self, message: str) -> None:
        self.lines.append(("warn", message))

    def log_error(self, message: str) -> None:
        self.lines.append(("error", message))

    def log_verbose(self, message: str) -> None:
        self.lines.append(("verbose", message))

    def said(self, level: str) -> list[str]:
        return [m for lv, m in self.lines if lv == level]


def fake_pb_utils() -> types.ModuleType:
    """A fresh fake ``triton_python_backend_utils``: its own log, and every MetricFamily made through it
    listed in ``families`` by name."""
    pb = types.ModuleType("triton_python_backend_utils")
    families: dict[str, MetricFamily] = {}

    class _Family(MetricFamily):
        def __init__(self, name: str, description: str, kind: str) -> None:
            # Triton merges families of one name, kind and description (a fresh one replaces a dropped one:
            # vlora.server.metrics's LoRA info gauge); anything else under a taken name is a mistake.
            old = families.get(name)
            if old is not None and (old.kind, old.description) != (kind, description):
                raise ValueError(f"metric family {name} registered twice")
            super().__init__(name, description, kind)
            families[name] = self

    pb.Tensor, pb.TritonError, pb.InferenceResponse = Tensor, TritonError, InferenceResponse
    pb.get_input_tensor_by_name = get_input_tensor_by_name
    pb.MetricFamily, pb.families = _Family, families
    pb.Logger = _Logger()
    pb.TRITONSERVER_RESPONSE_COMPLETE_FINAL = COMPLETE_FINAL
    pb.TritonModelException = TritonModelException
    pb.using_decoupled_model_transaction_policy = using_decoupled_model_transaction_policy
    return pb


class TritonModelException(Exception):
    pass


def using_decoupled_model_transaction_policy(model_config: dict) -> bool:
    return bool(model_config.get("model_transaction_policy", {}).get("decoupled", False))
