"""The KV cache pool: zeros on first touch, writable, plain zeros for other dtypes."""
from __future__ import annotations

import pytest
import torch

from tokenmill.platforms.cpu import lazy_zeros as _lazy_zeros


@pytest.mark.parametrize("shape", [(3, 4096, 64), (2, 8, 16), (0, 4)])   # 3 MiB, 1 KiB, empty
def test_pool_is_zero_and_writable(shape):
    t = _lazy_zeros(shape, torch.float32)
    assert t.shape == shape and t.dtype == torch.float32 and t.is_contiguous()
    assert not t.any()
    if t.numel():
        t.view(-1)[-1] = 1.5                                             # last element is inside the mapping
        assert t.sum().item() == 1.5


def test_other_dtypes_are_plain_zeros():
    t = _lazy_zeros((1024, 1024), torch.bfloat16)
    assert t.dtype == torch.bfloat16 and not t.any()
