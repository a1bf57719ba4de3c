"""AttnRes kernels (codegen/triton/attn_res.py): `attn_res_mix` vs the reference and
`fused.attn_res_mix_norm` (with and without the fused prefix add) vs its unfused body.
CPU: Triton interpreter, fp32, tiny shapes."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from codegen.registry import templates_for
from codegen.triton import attn_res
from ir.core import Module
from ir.interpreter import Interpreter
from ir.ref import basic as ref
from k31c.model.build import build_module
from k31c.model.presets import get_preset
from passes import attn_res_fusion
from passes.base import PassContext
from tests.helpers import assert_close_rel

MIX = templates_for("attn_res_mix")[0]
FUSED = templates_for("fused.attn_res_mix_norm")[0]


def _run(t, a, attrs, target="cpu"):
    attrs = {"batch_invariant": False, **attrs}
    return t.launch(a, attrs, t.heuristic(t.key_dims(a, attrs), target))


@pytest.mark.parametrize("n", [1, 4, 9])
def test_mix_matches_reference(n):
    g = torch.Generator().manual_seed(n)
    sources = [torch.randn(2, 3, 200, generator=g) * (1 + i) for i in range(n)]
    proj, norm = torch.randn(1, 200, generator=g), torch.randn(200, generator=g)
    y = _run(MIX, SimpleNamespace(proj=proj, norm=norm, sources=sources), {"eps": 1e-5})
    want = ref.attn_res_mix([s.double() for s in sources], proj.double().reshape(-1), norm.double(), 1e-5)
    assert_close_rel(y, want, 1e-5, f"attn_res_mix n={n}")


def _fused_nodes():
    m = build_module(get_preset("k31-tiny"))
    assert attn_res_fusion.run(m, PassContext()) > 0
    nodes = [n for n in m.function("prefill").nodes if n.op == "fused.attn_res_mix_norm"]
    with_add = next(n for n in nodes if n.attrs["prefix_add"])
    without = max((n for n in nodes if not n.attrs["prefix_add"]), key=lambda n: n.attrs["bank"])
    return with_add, without


@pytest.mark.parametrize("prefix_add", [True, False])
def test_fused_mix_norm_matches_unfused_body(prefix_add):
    node = _fused_nodes()[0 if prefix_add else 1]
    g = torch.Generator().manual_seed(10 + prefix_add)
    ops = [torch.randn(*[5 if not d.is_number else int(d) for d in v.type.shape], generator=g) * (1 + 0.5 * i)
           for i, v in enumerate(node.inputs)]
    want = Interpreter(Module("body"), {}).run(node.body, ops)
    got = _run(FUSED, SimpleNamespace(operands=ops), dict(node.attrs))
    got = list(got) if isinstance(got, tuple) else [got]
    assert len(got) == len(want) == (2 if prefix_add else 1)
    for i, (a, b) in enumerate(zip(got, want)):
        assert_close_rel(a, b, 1e-5, f"result {i} (prefix_add={prefix_add}, bank={node.attrs['bank']})")


@pytest.mark.parametrize("prefetch", [0, 2, 4])
def test_early_form_gives_the_same_bits(prefetch):
    """EARLY (bank rows and prev read and scored before the PDL wait) is a reordering of loads, not of arithmetic:
    the same bits as the plain form for every PREFETCH (scored rows kept or reloaded), and close to the body."""
    node = _fused_nodes()[0]
    g = torch.Generator().manual_seed(20 + prefetch)
    ops = [torch.randn(*[3 if not d.is_number else int(d) for d in v.type.shape], generator=g) * (1 + 0.3 * i)
           for i, v in enumerate(node.inputs)]
    attrs = {"batch_invariant": False, **node.attrs}
    cfg = {**FUSED.heuristic(FUSED.key_dims(SimpleNamespace(operands=ops), attrs), "cpu"), "PREFETCH": prefetch}
    proj, mnorm, w, bank, prev, part = attn_res.split_fused(ops, attrs)
    kw = dict(part=part, norm_weight=w, norm_eps=attrs["norm_eps"])
    early = attn_res.attn_res_mix(bank, prev, proj, mnorm, attrs["eps"], cfg, early=True, **kw)
    plain = attn_res.attn_res_mix(bank, prev, proj, mnorm, attrs["eps"], cfg, early=False, **kw)
    assert all(torch.equal(a, b) for a, b in zip((early[0], early[2]), (plain[0], plain[2])))
    want = Interpreter(Module("body"), {}).run(node.body, ops)
    assert_close_rel(early[2], want[1], 1e-5, f"h (EARLY, PREFETCH={prefetch}, bank={node.attrs['bank']})")


def test_fused_batch_invariant():
    node = _fused_nodes()[0]
    g = torch.Generator().manual_seed(12)
    ops = [torch.randn(*[6 if not d.is_number else int(d) for d in v.type.shape], generator=g) for v in node.inputs]
    attrs = {**node.attrs, "batch_invariant": True}
    prefix, h = _run(FUSED, SimpleNamespace(operands=ops), attrs)
    for r in (0, 5):
        one = [o if o.shape[0] != 6 or o.dim() == 1 else o[r:r + 1].clone() for o in ops]
        p1, h1 = _run(FUSED, SimpleNamespace(operands=one), attrs)
        assert torch.equal(p1, prefix[r:r + 1]) and torch.equal(h1, h[r:r + 1]), f"row {r} differs alone"
    cfgs = {str(attn_res.heuristic(attn_res._bucket(dict(T=t, d=7168, n=9, bi=1)), "h200")) for t in (1, 6, 4096)}
    assert len(cfgs) == 1


def test_supports_and_bad_input():
    from ir.core import TensorType

    src = [TensorType.of("bf16", ("B", 7168))] * 17
    assert "at most 15" in MIX.supports(SimpleNamespace(sources=src), {}, "h200")
    assert MIX.supports(SimpleNamespace(sources=src[:9]), {}, "h200") is None
    with pytest.raises(ValueError, match="takes 7 operands"):
        FUSED.launch(SimpleNamespace(operands=[torch.randn(4)] * 5), {"bank": 2, "prefix_add": True, "eps": 1e-5,
                                                                      "norm_eps": 1e-5}, {})
    with pytest.raises(ValueError, match="sources differ"):
        attn_res.attn_res_mix([torch.randn(2, 8)], torch.randn(3, 8), torch.randn(8), torch.randn(8), 1e-5,
                              dict(BLOCK_R=1, BLOCK_D=8, num_warps=1))
