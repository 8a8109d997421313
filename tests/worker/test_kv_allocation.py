"""The KV cache pool: zeros on first touch, huge-page aligned where the OS offers huge pages."""
from __future__ import annotations

import mmap

import pytest
import torch

from tokenmill.worker.model_runner import HUGE_PAGE, _lazy_zeros


@pytest.mark.parametrize("shape", [(3, 4096, 64), (2, 8, 16)])          # 3 MiB (mapped) and 1 KiB (plain)
def test_pool_is_zero_writable_and_aligned(shape):
    t = _lazy_zeros(shape, torch.float32)
    assert t.shape == shape and t.dtype == torch.float32 and t.is_contiguous()
    assert not t.any()
    t[-1, -1, -1] = 1.5                                                  # last element is inside the mapping
    assert t.sum().item() == 1.5
    if hasattr(mmap, "MADV_HUGEPAGE") and t.numel() * 4 >= HUGE_PAGE:
        assert t.data_ptr() % HUGE_PAGE == 0


def test_other_dtypes_are_plain_zeros():
    t = _lazy_zeros((1024, 1024), torch.bfloat16)
    assert t.dtype == torch.bfloat16 and not t.any()
