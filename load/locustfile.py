"""Entry point for running the vlora locust users by hand: ``locust -f load/locustfile.py ...``.

The users live in ``vlora.loadtest.locustfile`` (so ``vlora loadtest`` finds them in an installed
package too); importing them here registers the users and their command-line option with locust.
Run ``vlora loadtest --help`` for the usual headless way; see load/README.md.
"""
from vlora.loadtest.locustfile import ClosedLoopUser, OpenLoopUser  # noqa: F401
