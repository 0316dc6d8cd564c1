"""vlora.lora.carve: views of one buffer by indexing, against views made one by one."""
from __future__ import annotations

import torch

from vlora.lora.carve import carve_bytes


def test_carved_views_equal_views_made_one_by_one_and_share_the_buffer():
    g = torch.Generator().manual_seed(0)
    buf = torch.randint(0, 256, (1 << 16,), dtype=torch.uint8, generator=g)
    items, at = [], 0
    for i in range(60):
        dtype = (torch.float32, torch.bfloat16, torch.float16, torch.int8)[i % 4]
        shape = [(int(torch.randint(1, 9, (1,), generator=g)), 16), (7, 3, 5), (11,), ()][i % 4]
        at = -(-at // dtype.itemsize) * dtype.itemsize + (i % 3) * dtype.itemsize  # phases vary
        items.append((at, dtype, shape))
        n = dtype.itemsize * (torch.Size(shape).numel())
        at += n
    views = carve_bytes(buf, items)
    for (at, dtype, shape), v in zip(items, views):
        n = dtype.itemsize * torch.Size(shape).numel()
        want = buf[at:at + n].view(dtype).view(shape)
        assert v.dtype == dtype and tuple(v.shape) == tuple(shape) and v.is_contiguous()
        assert v.data_ptr() == want.data_ptr() and torch.equal(v.view(torch.uint8) if v.dim() else v.reshape(1).view(torch.uint8),
                                                               want.view(torch.uint8) if want.dim() else want.reshape(1).view(torch.uint8))
