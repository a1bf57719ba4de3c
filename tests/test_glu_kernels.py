"""Elementwise kernels of codegen/triton/glu.py (`situ_glu`, `swiglu`, `add`) and the gather of
codegen/triton/embedding.py vs their references (ir/ref/basic.py in float64, torch indexing) on random
inputs: strided column views of a packed projection, beta variants, saturating and tiny arguments;
and the compile of k31-tiny / the rank preset selecting `situ_glu` and `embedding_rms_norm` (the embedding
fused with layer 0's input norm) while `add` falls back with the measured reason. CPU: Triton interpreter, fp32, tiny shapes."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from codegen.registry import templates_for
from codegen.select import select_kernels
from codegen.triton import embedding as emb
from codegen.triton import glu
from ir.ref.basic import situ_glu, swiglu
from tests.helpers import assert_close_rel

SITU, SWIGLU, ADD = (templates_for(op)[0] for op in ("situ_glu", "swiglu", "add"))
EMBED = templates_for("embedding")[0]


def _launch(t, a, attrs=None):
    attrs = {"batch_invariant": False, **(attrs or {})}
    return t.launch(a, attrs, t.heuristic(t.key_dims(a, attrs), "cpu"))


def _packed_pair(rows, c, g, scale=3.0):
    """a, u: the two column halves of one [rows, 2c] projection output (row stride 2c)."""
    both = torch.randn(rows, 2 * c, generator=g) * scale
    return both[:, :c], both[:, c:]


@pytest.mark.parametrize("beta1,beta2", [(4.0, 25.0), (4.0, None), (None, None), (0.5, 2.0)])
@pytest.mark.parametrize("rows,c", [(3, 200), (1, 3072 // 8)])
def test_situ_glu_matches_reference(beta1, beta2, rows, c):
    g = torch.Generator().manual_seed(rows * 1000 + c)
    a, u = _packed_pair(rows, c, g)
    y = _launch(SITU, SimpleNamespace(a=a, u=u), {"beta1": beta1, "beta2": beta2})
    want = situ_glu(a.double(), u.double(), beta1, beta2)
    assert y.dtype == a.dtype and y.is_contiguous()
    assert_close_rel(y, want, 1e-5, f"situ_glu beta1={beta1} beta2={beta2}")


@pytest.mark.filterwarnings("error::RuntimeWarning")  # sigmoid and tanh never overflow exp
def test_situ_glu_tiny_and_saturating_arguments():
    """|x| < 0.25 runs the Taylor branch of tanh (no cancellation), |x| >> beta saturates: both per element."""
    g = torch.Generator().manual_seed(11)
    mags = torch.tensor([1e-6, 1e-3, 0.2, 0.26, 3.0, 60.0, 400.0]).repeat(40)
    a = torch.randn(2, mags.numel(), generator=g).sign() * mags
    u = torch.randn(2, mags.numel(), generator=g).sign() * mags.flip(0)
    y = _launch(SITU, SimpleNamespace(a=a, u=u), {"beta1": 4.0, "beta2": 25.0})
    want = situ_glu(a.double(), u.double(), 4.0, 25.0)
    elem = ((y.double() - want).abs() / want.abs().clamp_min(1e-30))
    assert torch.isfinite(y).all() and float(elem.max()) < 2e-6, f"worst element rel err {float(elem.max()):.2e}"


def test_swiglu_and_add_match_reference():
    g = torch.Generator().manual_seed(2)
    a, u = _packed_pair(4, 300, g)
    assert_close_rel(_launch(SWIGLU, SimpleNamespace(a=a, u=u)), swiglu(a.double(), u.double()), 1e-5, "swiglu")
    x, y = torch.randn(2, 3, 70, generator=g), torch.randn(2, 3, 70, generator=g)
    assert_close_rel(_launch(ADD, SimpleNamespace(a=x, b=y)), x.double() + y.double(), 1e-6, "add")


def test_fp64_operands_compute_in_fp64():
    g = torch.Generator().manual_seed(4)
    a, u = (t.double() for t in _packed_pair(2, 64, g))
    y = _launch(SITU, SimpleNamespace(a=a, u=u), {"beta1": 4.0, "beta2": 25.0})
    assert y.dtype == torch.float64
    assert_close_rel(y, situ_glu(a, u, 4.0, 25.0), 1e-12, "situ_glu fp64")


def test_mismatched_shapes_are_named():
    with pytest.raises(ValueError, match="differ in shape"):
        glu.binary("situ_glu", torch.randn(2, 8), torch.randn(2, 9), {"BLOCK_R": 1, "BLOCK_C": 256, "num_warps": 4})


# ---- embedding (codegen/triton/embedding.py) --------------------------------------------------------
def test_embedding_gathers_rows():
    g = torch.Generator().manual_seed(6)
    table = torch.randn(50, 96, generator=g)
    ids = torch.randint(-50, 50, (3, 5), generator=g)
    y = _launch(EMBED, SimpleNamespace(table=table, ids=ids))
    assert y.shape == (3, 5, 96) and torch.equal(y, table[ids])


# ---- selection on real compiles --------------------------------------------------------------------
@pytest.mark.parametrize("cfg_name", ["k31-tiny", "rank"])
def test_compile_selects_situ_glu_and_explains_the_rest(cfg_name):
    from tests.test_mla_query_kernels import _module

    m = _module("f8e4m3", "blocks", cfg_name)
    choices = select_kernels(m, "h200")
    # the FFN GLUs run in their packed GEMM's epilogue (passes/glu_epilogue.py); a GLU left standalone
    # (none in these models) would take the elementwise kernel
    glus = [c for c in choices if c.op in ("situ_glu", "fused.packed_linear_glu")]
    assert glus and all(c.kernel == {"situ_glu": "situ_glu", "fused.packed_linear_glu": "packed_glu_gemm"}[c.op]
                        for c in glus), [c.reason for c in glus if c.template is None]
    # the embedding gathers its rows into layer 0's input norm (passes/embedding_norm.py)
    assert {c.kernel for c in choices if c.op in ("embedding", "fused.embedding_rms_norm")} == {"embedding_rms_norm"}
    # every add of these models is fused (the last one into the output mix, passes/attn_res_fusion.py); the
    # add template declines the H200 with its measured reason
    assert not [c for c in choices if c.op == "add"]
    assert "not measurably faster on the H200" in glu._measured_slower("add", "h200")
