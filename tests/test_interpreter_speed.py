"""tests/_interpreter_speed.py: the memoised `_patch_builtin` is active in the test session, a kernel with nested
`@triton.jit` calls gives bitwise the same results with it and with the interpreter's own, and after a launch
`triton.language` holds its original builtins again."""

from __future__ import annotations

import os

import pytest
import torch

import triton
import triton.language as tl

pytestmark = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="conftest installs the memoised "
                                "patch only where kernels run in Triton's interpreter (CPU sessions, as in CI)")


@triton.jit
def _inner(x, k):
    return tl.where(x > 0, tl.exp(-x) * k, tl.sum(x, 0) + k)


@triton.jit
def _nested_kernel(x_ptr, y_ptr, N: tl.constexpr):
    pid = tl.program_id(0)
    offs = pid * N + tl.arange(0, N)
    x = tl.load(x_ptr + offs)
    y = _inner(x, pid.to(tl.float32)) + _inner(-x, 1.0)
    tl.store(y_ptr + offs, tl.cumsum(y, 0))


def _run(x):
    y = torch.empty_like(x)
    _nested_kernel[(x.numel() // 16,)](x, y, N=16)
    return y


def test_memoised_patch_is_installed_and_changes_nothing(monkeypatch):
    from triton.runtime import interpreter

    assert getattr(interpreter._patch_builtin, "memoised", False), "conftest did not install the memoised patch"
    x = torch.randn(16 * 7, generator=torch.Generator().manual_seed(3))
    originals = {name: getattr(tl, name) for name in ("exp", "where", "load", "store", "arange")}
    assert all(tl.core.is_builtin(f) for f in originals.values())
    fast = _run(x)
    assert {name: getattr(tl, name) for name in originals} == originals   # restored after the launch
    with monkeypatch.context() as m:
        m.setattr(interpreter, "_patch_builtin", interpreter._patch_builtin.__wrapped__)
        slow = _run(x)
    assert not torch.isnan(fast).any() and torch.equal(fast, slow)
    assert {name: getattr(tl, name) for name in originals} == originals
    expect = (torch.where(x > 0, torch.exp(-x) * torch.arange(7).repeat_interleave(16).float(),
                          x.view(7, 16).sum(1).repeat_interleave(16) + torch.arange(7).repeat_interleave(16))
              + torch.where(-x > 0, torch.exp(x), (-x).view(7, 16).sum(1).repeat_interleave(16) + 1.0))
    torch.testing.assert_close(fast, expect.view(7, 16).cumsum(1).view(-1), rtol=1e-5, atol=1e-5)
