"""``vlora train``: one LoRA adapter (PEFT), with or without task heads, on generated or folder datasets."""
from vlora.fusion.commands import train_add_arguments as add_arguments, train_run as run

__all__ = ["add_arguments", "run"]
