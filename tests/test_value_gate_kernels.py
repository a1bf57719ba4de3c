"""Value projection (+ sigmoid gate) kernels (codegen/triton/value_gate.py): `mla_value_proj` vs the
reference and `fused.value_gate` vs its unfused body (built by passes/value_gate.py on k31-tiny).
CPU: Triton interpreter, fp32, tiny shapes."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from codegen.registry import templates_for
from codegen.triton import value_gate as vg
from ir.core import Module
from ir.interpreter import Interpreter
from ir.ref.mla import mla_value_proj
from k31c.model.build import build_module
from k31c.model.presets import get_preset
from passes import value_gate as value_gate_pass
from passes.base import PassContext
from tests.helpers import assert_close_rel

PROJ = templates_for("mla_value_proj")[0]
FUSED = templates_for("fused.value_gate")[0]


def _run(t, a, attrs, target="cpu"):
    attrs = {"batch_invariant": False, **attrs}
    return t.launch(a, attrs, t.heuristic(t.key_dims(a, attrs), target))


@pytest.mark.parametrize("T,H,kv,dn,dv", [(5, 4, 64, 32, 32), (3, 2, 48, 16, 24)])
def test_value_proj_matches_reference(T, H, kv, dn, dv):
    g = torch.Generator().manual_seed(T * H)
    o = torch.randn(T, H, kv, generator=g)
    kv_b = torch.randn(H * (dn + dv), kv, generator=g)
    y = _run(PROJ, SimpleNamespace(o_latent=o, kv_b=kv_b), {"nope_dim": dn})
    assert_close_rel(y, mla_value_proj(o.double(), kv_b.double(), dn), 1e-5, "mla_value_proj")


def _fused_node():
    m = build_module(get_preset("k31-tiny"))
    assert value_gate_pass.run(m, PassContext()) > 0
    return next(n for n in m.function("decode").nodes if n.op == "fused.value_gate")


def _operands(node, rows, g):
    return [torch.randn(*[rows if not d.is_number else int(d) for d in v.type.shape], generator=g) * 2
            for v in node.inputs]


def test_fused_value_gate_matches_unfused_body():
    node = _fused_node()
    ops = _operands(node, 5, torch.Generator().manual_seed(8))
    want = Interpreter(Module("body"), {}).run(node.body, ops)
    got = _run(FUSED, SimpleNamespace(operands=ops), dict(node.attrs))
    assert_close_rel(got, want[0], 1e-5, "fused.value_gate")


def test_fused_value_gate_batch_invariant():
    node = _fused_node()
    ops = _operands(node, 6, torch.Generator().manual_seed(9))
    attrs = {**node.attrs, "batch_invariant": True}
    together = _run(FUSED, SimpleNamespace(operands=ops), attrs)
    for r in (0, 5):
        alone = _run(FUSED, SimpleNamespace(operands=[ops[0][r:r + 1].clone(), ops[1], ops[2][r:r + 1].clone()]), attrs)
        assert torch.equal(alone, together[r:r + 1]), f"row {r} differs alone vs in batch"
    cfgs = {str(vg.heuristic(vg._bucket(dict(T=t, H=96, KV=512, DV=128, bi=1)), "h200")) for t in (1, 8, 4096)}
    assert len(cfgs) == 1


def test_bad_input():
    with pytest.raises(ValueError, match="leaves no value rows"):
        vg.value_gate(torch.randn(2, 2, 8), torch.randn(8, 8), 4, vg.heuristic(dict(T=2, H=2, KV=8, DV=1, bi=0), "cpu"))
    with pytest.raises(ValueError, match="gate"):
        vg.value_gate(torch.randn(2, 2, 8), torch.randn(16, 8), 4, vg.heuristic(dict(T=2, H=2, KV=8, DV=4, bi=0), "cpu"),
                      gate=torch.randn(2, 4))
    assert "nope_dim" in FUSED.supports(SimpleNamespace(operands=[torch.empty(1, 2, 8), torch.empty(16, 8)]), {}, "h200")
