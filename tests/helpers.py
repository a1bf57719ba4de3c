"""Shared test helpers."""

from __future__ import annotations

import os

import pytest
import torch

# a site-packages folder holding Triton 3.6 (the H200's compiler): the offline sm_90 builds with 3.6 run only where
# K31C_TRITON36_SITE names one (CI has this machine's Triton only)
TR36 = os.environ.get("K31C_TRITON36_SITE", "")
TR36_REASON = ("needs Triton 3.6 (the H200's compiler) in the folder K31C_TRITON36_SITE names; the same build under "
               "this machine's Triton (CI's only one) is checked beside it")


def skip_without_triton36(tr36: bool):
    """In a test parametrised over tr36: skip the Triton 3.6 case where no 3.6 site folder is given."""
    if tr36 and not os.path.isdir(TR36):
        pytest.skip(TR36_REASON)


def assert_close_rel(actual: torch.Tensor, expected: torch.Tensor, tol: float, what: str = ""):
    """Assert both tensors are finite, same shape, expected is non-zero, and
    ||actual - expected|| / ||expected|| < tol (norms computed in float64)."""
    actual = torch.as_tensor(actual)
    expected = torch.as_tensor(expected)
    tag = f" [{what}]" if what else ""
    assert actual.shape == expected.shape, \
        f"shape mismatch{tag}: {tuple(actual.shape)} vs {tuple(expected.shape)}"
    a = actual.detach().to("cpu", torch.float64)
    b = expected.detach().to("cpu", torch.float64)
    assert torch.isfinite(a).all(), f"non-finite values in actual{tag}"
    assert torch.isfinite(b).all(), f"non-finite values in expected{tag}"
    nb = torch.linalg.vector_norm(b).item()
    assert nb > 0, f"expected is all zeros{tag}: refusing to compare on zeros"
    err = torch.linalg.vector_norm(a - b).item() / nb
    assert err < tol, f"rel err {err:.3e} >= {tol:.1e}{tag}"
    return err


def contiguous_table(bases, length: int) -> torch.Tensor:
    """Block table with block_size 1 that puts request r's position p at row bases[r] + p (the
    contiguous per-request layout as a special case of paging)."""
    return torch.tensor([[int(b) + p for p in range(length)] for b in bases], dtype=torch.int32)


def scattered_table(lengths, block_size: int, seed: int, spare: int = 3):
    """(block_table int32 [R, MB], num_blocks): every request's blocks drawn at random, in random order,
    from a pool with `spare` unused blocks; entries past a request's blocks are -1."""
    need = [-(-int(n) // block_size) for n in lengths]
    total = sum(need) + spare
    perm = torch.randperm(total, generator=torch.Generator().manual_seed(seed)).tolist()
    width = max(need)
    rows, at = [], 0
    for n in need:
        rows.append(perm[at:at + n] + [-1] * (width - n))
        at += n
    return torch.tensor(rows, dtype=torch.int32), total


def paged_row(block_table: torch.Tensor, block_size: int, r: int, p: int) -> int:
    """The pool row of request r's position p, written out in plain Python for test formulas."""
    return int(block_table[r, p // block_size]) * block_size + p % block_size
