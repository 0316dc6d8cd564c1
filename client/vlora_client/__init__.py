"""Client for vlora on Triton: a library (``VloraClient``) and the ``vlora-client`` command."""
from vlora_client.client import (
    GenerationResult,
    StreamDelta,
    VloraClient,
    VloraClientError,
    VloraConnectionError,
    encode_image,
    sampling_parameters,
)

__all__ = ["GenerationResult", "StreamDelta", "VloraClient", "VloraClientError", "VloraConnectionError", "encode_image", "sampling_parameters"]
