"""The 1-bit codec and its two-level error-feedback average (compression/onebit.py)."""
from __future__ import annotations

import torch

from hybrid_ray.engine.compression.onebit import (SignAverage, compress, decompress, pack_signs,
                                                  payload_bytes, unpack_signs)


def test_signs_round_trip_through_their_bytes():
    x = torch.randn(1001, generator=torch.Generator().manual_seed(0))
    x[5] = 0.0  # zero is sent as +1
    packed = pack_signs(x)
    assert packed.dtype == torch.uint8 and packed.numel() == 126 == payload_bytes(1001) - 4
    signs = unpack_signs(packed, 1001)
    assert torch.equal(signs, torch.where(x >= 0, 1.0, -1.0))


def test_the_scale_keeps_the_norm():
    x = torch.randn(4096, generator=torch.Generator().manual_seed(1))
    scale, bits = compress(x)
    sent = decompress(scale, bits, x.numel())
    assert torch.allclose(sent.norm(), x.norm(), rtol=1e-5)


def test_error_feedback_loses_nothing_over_time():
    """Averaging the same W tensors over many steps: the decoded averages' running mean
    converges to the true average (the residuals carry what each step did not send)."""
    g = torch.Generator().manual_seed(2)
    tensors = [torch.randn(777, generator=g) for _ in range(3)]
    truth = torch.stack(tensors).mean(0)
    avg = SignAverage(3)
    steps = 400
    total = sum(avg.average("b", tensors) for _ in range(steps))
    single = (SignAverage(3).average("b", tensors) - truth).norm() / truth.norm()
    avg_error = (total / steps - truth).norm() / truth.norm()
    assert single > 0.3  # one step alone is a crude sign sketch
    assert avg_error < 0.05  # error feedback: nothing is lost, only delayed


def test_the_zero_form_loses_nothing_over_time_either():
    g = torch.Generator().manual_seed(3)
    tensors = [torch.randn(501, generator=g) for _ in range(2)]
    truth = torch.stack(tensors).mean(0)
    avg = SignAverage(2)
    steps = 400
    mean = sum(avg.reduce("b", tensors) for _ in range(steps)) / steps
    assert (mean - truth).norm() / truth.norm() < 0.05
