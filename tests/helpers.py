"""Shared test helpers."""

from __future__ import annotations

import torch


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
