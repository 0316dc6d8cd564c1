"""``vlora fuse``: pack datasets into the fewest adapters that keep every task above its accuracy floor."""
from vlora.fusion.commands import fuse_add_arguments as add_arguments, fuse_run as run

__all__ = ["add_arguments", "run"]
