"""The read-bandwidth kernel of the benches' ceilings (benches/_read_ceiling.py) reads every element once: its per-
program sums (interpreter, fp32) equal float64 sums of the same contiguous pieces."""

from __future__ import annotations

import torch

from benches import _read_ceiling as rc


def test_read_kernel_reads_every_element_once():
    g = torch.Generator().manual_seed(int(torch.randint(0, 2 ** 31, ()).item()))
    block, iters = 64, 4
    x = torch.randn(5 * block * iters, generator=g)
    part = torch.full((5,), float("nan"))
    rc._read_kernel[(5,)](x, part, BLOCK=block, ITERS=iters, num_warps=1)
    want = x.double().view(5, block * iters).sum(1)
    assert not torch.isnan(part).any()
    assert torch.allclose(part.double(), want, rtol=1e-5, atol=1e-4)
