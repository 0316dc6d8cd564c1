"""Accuracy-aware knowledge fusion and the data it needs.

- :mod:`vlora.fusion.datasets`: seeded pillow vision datasets (counting, colour, shape, target
  presence, action over frames) and plain-folder datasets, with train/val/test splits and prompts;
- :mod:`vlora.fusion.train`: one PEFT LoRA adapter with task heads, trained and evaluated (``vlora train``);
- :mod:`vlora.fusion.fuse`: the greedy packing of datasets into the fewest adapters that keep every
  accuracy floor, with bit-identical rollback (``vlora fuse``), and :mod:`vlora.fusion.report`;
- :mod:`vlora.fusion.demo`: the trained demo adapters of ``make serve``.
"""
