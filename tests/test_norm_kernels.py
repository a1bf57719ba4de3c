"""Norm / rotation / quantisation kernels (codegen/triton/norm_quant.py): rms_norm, layer_norm, hadamard,
quantize_fp8_pow2 (bit-exact vs ir.formats) and the fused indexer front vs its unfused body.
CPU: Triton interpreter, fp32, tiny shapes."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from codegen.registry import templates_for
from codegen.triton import norm_quant as nq
from codegen.triton import indexer_front as fr
from ir import formats
from ir.core import Module
from ir.interpreter import Interpreter
from ir.ref import basic as ref
from k31c.model.build import BuildOptions, build_module
from k31c.model.presets import get_preset
from passes import fused_indexer_front, packed_projection
from passes.base import PassContext
from tests.helpers import assert_close_rel


FRONT = fr.TEMPLATES[0]


def _template(op):
    return templates_for(op)[0]


def _run(op, a, attrs, target="cpu"):
    t = _template(op) if isinstance(op, str) else op
    attrs = {**attrs, "batch_invariant": attrs.get("batch_invariant", False)}
    return t.launch(a, attrs, t.heuristic(t.key_dims(a, attrs), target))


def test_rms_norm_with_and_without_weight():
    g = torch.Generator().manual_seed(1)
    x = torch.randn(3, 5, 200, generator=g) * 3
    w = torch.randn(200, generator=g)
    for weight in (w, None):
        y = _run("rms_norm", SimpleNamespace(x=x, weight=weight), {"eps": 1e-5})
        assert_close_rel(y, ref.rms_norm(x.double(), None if weight is None else weight.double(), 1e-5), 1e-5,
                         f"rms_norm weight={weight is not None}")


def test_layer_norm():
    g = torch.Generator().manual_seed(2)
    x = torch.randn(7, 96, generator=g) * 2 + 1.5
    w, b = torch.randn(96, generator=g), torch.randn(96, generator=g)
    y = _run("layer_norm", SimpleNamespace(x=x, weight=w, bias=b), {"eps": 1e-6})
    assert_close_rel(y, ref.layer_norm(x.double(), w.double(), b.double(), 1e-6), 1e-5, "layer_norm")


def test_hadamard():
    x = torch.randn(6, 4, 32, generator=torch.Generator().manual_seed(3))
    y = _run("hadamard", SimpleNamespace(x=x), {})
    assert_close_rel(y, ref.hadamard_rotate(x.double()), 1e-5, "hadamard")


def test_quantize_fp8_pow2_is_bit_exact():
    g = torch.Generator().manual_seed(4)
    x = torch.randn(48, 32, generator=g) * torch.logspace(-7, 4, 48)[:, None]  # amax floor to huge
    x[0, :10] = torch.tensor([448.0, 0.0, -0.0, 1e-9, 2 ** -9, 3 * 2 ** -10, 2 ** -6 * 1.0625, -5 * 2 ** -10,
                              1.0 + 1 / 16, 240.0 + 8])  # the amax, zeros, subnormals, round-half-even ties
    q, s = _run("quantize_fp8_pow2", SimpleNamespace(x=x), {})
    rq, rs = formats.quantize_fp8_pow2(x)
    assert q.dtype == torch.float8_e4m3fn and s.dtype == torch.float32
    assert torch.equal(q.view(torch.uint8), rq.view(torch.uint8)), "fp8 bytes differ from ir.formats"
    assert torch.equal(s, rs), "scales differ from ir.formats"


def test_rms_norm_batch_invariant():
    g = torch.Generator().manual_seed(5)
    x, w = torch.randn(6, 160, generator=g), torch.randn(160, generator=g)
    attrs = {"eps": 1e-5, "batch_invariant": True}
    together = _run("rms_norm", SimpleNamespace(x=x, weight=w), attrs)
    for r in (0, 4):
        alone = _run("rms_norm", SimpleNamespace(x=x[r:r + 1].clone(), weight=w), attrs)
        assert torch.equal(alone, together[r:r + 1])
    cfgs = {str(nq.row_heuristic(nq.row_bucket(dict(R=r, D=7168, rot=0, bi=1)), "h200")) for r in (1, 6, 4096)}
    assert len(cfgs) == 1


def _front_node():
    m = build_module(get_preset("k31-tiny"), BuildOptions(block_size=16, pool_view="flat"))
    ctx = PassContext()
    packed_projection.run(m, ctx)
    assert fused_indexer_front.run(m, ctx) > 0
    return next(n for n in m.function("verify").nodes if n.op == "fused.indexer_front")


def _front_operands(node, T, N, g):
    dims = {"B": T, "N": N, "R": 2, "MB": 2}
    ops = []
    for v in node.inputs:
        shape = [dims[str(d)] if not d.is_number else int(d) for d in v.type.shape]
        if v.type.dtype.name == "f8e4m3":
            ops.append((torch.randn(*shape, generator=g) * 8).to(torch.float8_e4m3fn))
        elif v.type.dtype.kind == "float":
            ops.append(torch.randn(*shape, generator=g) * (3.0 if v.name.endswith("ik") else 1.0))
        else:
            ops.append(None)
    # two requests: 3 + 2 tokens at positions 4..6 and 0..1, in blocks 0 and 2 (block size 16) of a 48-row pool
    assert node.attrs["block_size"] == 16
    ops[-3] = torch.tensor([0, 0, 0, 1, 1])
    ops[-2] = torch.tensor([4, 5, 6, 0, 1])
    ops[-1] = torch.tensor([[0, -1], [2, -1]], dtype=torch.int32)
    return ops


def test_indexer_front_matches_unfused_body():
    node = _front_node()
    T, N = 5, 48
    ops = _front_operands(node, T, N, torch.Generator().manual_seed(6))
    clone = lambda xs: [x.clone() for x in xs]  # noqa: E731
    want = Interpreter(Module("body"), {}).run(node.body, clone(ops))
    mine = clone(ops)
    got = _run(FRONT, SimpleNamespace(operands=mine), dict(node.attrs))
    assert len(got) == 5
    q8, qs, w, keys, kscale = got
    assert keys is mine[6] and kscale is mine[7], "pools must be updated in place and returned"
    assert_close_rel(formats.dequantize_fp8(q8, qs), formats.dequantize_fp8(want[0], want[1]), 2e-2, "query fp8")
    assert_close_rel(qs, want[1], 1e-6, "query scales")
    assert_close_rel(w, want[2], 1e-6, "head weights")
    written = torch.tensor([4, 5, 6, 32, 33])
    untouched = torch.ones(N, dtype=torch.bool)
    untouched[written] = False
    assert torch.equal(keys.view(torch.uint8)[untouched], ops[6].view(torch.uint8)[untouched])
    assert torch.equal(kscale[untouched], ops[7][untouched])
    assert_close_rel(formats.dequantize_fp8(keys[written], kscale[written]),
                     formats.dequantize_fp8(want[3][written], want[4][written]), 2e-2, "index keys in the pool")
    mismatch = (q8.view(torch.uint8) != want[0].view(torch.uint8)).float().mean().item()
    assert mismatch < 0.02, f"{mismatch:.1%} of query fp8 codes differ (only rounding ties may)"


def test_indexer_front_batch_invariant():
    node = _front_node()
    ops = _front_operands(node, 5, 48, torch.Generator().manual_seed(7))
    attrs = {**node.attrs, "batch_invariant": True}
    full = _run(FRONT, SimpleNamespace(operands=[o.clone() for o in ops]), attrs)
    one = [o.clone() for o in ops]
    for i in (0, 2, 3, 5):  # token 3 alone: c_q, ik, iw rows and its addressing
        one[i] = one[i][3:4].clone()
    one[8], one[9] = ops[8][3:4].clone(), ops[9][3:4].clone()
    alone = _run(FRONT, SimpleNamespace(operands=one), attrs)
    assert torch.equal(alone[0].view(torch.uint8), full[0][3:4].view(torch.uint8))
    assert torch.equal(alone[1], full[1][3:4]) and torch.equal(alone[2], full[2][3:4])


def test_bad_input_and_supports():
    from ir.core import TensorType

    t = _template("hadamard")
    assert "power-of-two" in t.supports(SimpleNamespace(x=TensorType.of("f32", ("B", 48))), {}, "cpu")
    assert _template("rms_norm").supports(SimpleNamespace(x=TensorType.of("bf16", ("B", 7168))), {}, "h200") is None
    assert "fp8_pow2" in FRONT.supports(SimpleNamespace(operands=[]), {"head_dim": 128, "quant": "mxfp4"}, "h200")
    with pytest.raises(ValueError, match="power-of-two"):
        nq.norm_rot_quant(torch.randn(2, 48), dict(BLOCK_R=16, BLOCK_D=48, num_warps=4), rotate=True)
    with pytest.raises(ValueError, match="takes"):
        fr.indexer_front([torch.randn(2, 8)], {"heads": 1, "head_dim": 8}, {})
