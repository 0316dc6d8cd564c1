"""The error types a client sees, in a leaf module that imports nothing: every package may raise them
(adapters, models, the orchestrator, the engine, the Triton model) without importing the engine."""


class InvalidRequest(ValueError):
    """A request the engine refuses before queueing it. The message is shown to the client as is."""


class EngineOverloaded(RuntimeError):
    """The engine could not admit the request within the admission timeout."""


class EngineDead(EngineOverloaded):
    """The engine thread died or stopped making progress: this instance serves nothing more. The
    message says why. (A kind of EngineOverloaded, so callers answer it as "unavailable".)"""


class RequestCancelled(RuntimeError):
    """The client went away before its request reached the engine (it waited for the image workers)."""
