"""The adapter's host-to-device copy: values and dtype as asked, the source array left alone."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from akv.system.adapter.device import to_device


def test_values_arrive_in_the_asked_dtype_from_any_layout() -> None:
    values = np.arange(12, dtype=np.int64).reshape(3, 4)[:, ::2]  # not contiguous
    out = to_device(values, "cpu", torch.int32)
    assert out.dtype == torch.int32 and out.tolist() == values.tolist()
    same = to_device(values, "cpu")
    assert same.dtype == torch.int64 and same.tolist() == values.tolist()


@pytest.mark.gpu
def test_a_cuda_copy_has_the_values_in_the_asked_dtype() -> None:
    values = np.arange(100_000, dtype=np.int64)[::-1]
    out = to_device(values, "cuda", torch.int32)
    torch.cuda.synchronize()
    assert out.is_cuda and out.dtype == torch.int32 and np.array_equal(out.cpu().numpy(), values)
