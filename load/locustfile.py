"""Entry point for running the vlora locust users by hand: ``locust -f load/locustfile.py ...``.

The users live in ``vlora_load.locustfile`` (load/vlora_load/locustfile.py, so that ``vlora loadtest`` finds
them in an installed package too); importing them here registers the users and their command-line option
with locust.
Run ``vlora loadtest --help`` for the usual headless way; see load/README.md.
"""
from vlora_load.locustfile import ClosedLoopUser, OpenLoopUser  # noqa: F401
