"""The serving engine: request state, the iteration loop, the paged KV cache, sampling, cancellation."""
from vlora.engine.api import (EngineOverloaded, GenerationOutput, GenerationRequest, InvalidRequest,
                              SamplingParams)

__all__ = ["AsyncEngine", "EngineOverloaded", "GenerationOutput", "GenerationRequest", "InvalidRequest", "SamplingParams"]


def __getattr__(name):  # the engine pulls in torch and transformers; import it only when asked for
    if name == "AsyncEngine":
        from vlora.engine.async_engine import AsyncEngine

        return AsyncEngine
    raise AttributeError(name)
