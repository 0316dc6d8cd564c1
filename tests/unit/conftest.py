"""Fixtures of the unit tests of the Triton model's modules (vlora.server.wire, admin, metrics)."""
from __future__ import annotations

import pytest

from fake_pb_utils import fake_pb_utils
from vlora.server.wire import Wire


@pytest.fixture
def pb():
    """A fresh fake triton_python_backend_utils (tests/fake_pb_utils.py): its own log and metric families."""
    return fake_pb_utils()


@pytest.fixture
def wire(pb):
    return Wire(pb)
