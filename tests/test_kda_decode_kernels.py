"""Fused KDA decode kernel (codegen/triton/kda_decode.py, helpers in _kda_common.py) against the unfused op
sequence it replaces (`passes/kda_decode_fusion.py`, run op by op through ir.ref: tests/kda_decode_case.py):
verification (1-8 tokens, per-token states and conv tails), split-V programs and their arrival counters, the
gate GEMM / rank blocks / dot-free GEMV gate, and the template's drop-in launch. CPU: Triton interpreter, fp32,
tiny shapes (benches/bench_kda.py checks bf16 at full shapes on a GPU)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from codegen.triton.kda_decode import TEMPLATES as DECODE_TEMPLATES
from codegen.triton.kda_decode import kda_decode
from ir.core import TensorType
from ir.ref import kda as ref
from tests.helpers import assert_close_rel
from tests.kda_decode_case import conv_tails as _conv_tails
from tests.kda_decode_case import decode_operands
from tests.kda_decode_case import unfused_decode as _unfused


def _gen(seed):
    return torch.Generator().manual_seed(seed)


@pytest.mark.parametrize("H,D,lengths,lb,rank,block_v,split,prefetch", [
    (2, 16, [1, 3, 8, 2], -5.0, 3, 16, 1, True),          # verification: 1..8 tokens per request, K3 gate
    (2, 32, [1, 2, 0, 5, 7, 4, 6, 8], None, 32, 16, 1, True),  # q_len 0..8, Kimi-Linear softplus gate
    (1, 64, [2, 1], -5.0, 64, 32, 1, False),               # the tiny model's head size, no prefetch
    (1, 16, [17, 1], -5.0, 16, 16, 1, True),               # more tokens than one group of 8
    (2, 32, [1, 3, 0, 8], -5.0, 32, 8, 2, True),           # head columns split over 2 programs (2 blocks each)
    (2, 32, [2, 8], -5.0, 32, 8, 2, False),                # the same without the one-block-ahead loads
    (1, 64, [1, 9], None, None, 16, 4, True),              # split 4, gate input f given whole (f_b None)
    (1, 64, [1, 1, 2], -5.0, 64, 8, 8, True),              # split 8 (the rank preset's B=1 heuristic form)
])
def test_decode_vs_unfused_sequence(H, D, lengths, lb, rank, block_v, split, prefetch):
    """Every case with one state block per program (BV = D/split) also loads the metadata and its state before
    the PDL wait (early; the same math, one group's state reloaded per later group of 8 tokens)."""
    g = _gen(7)
    S = len(lengths) + 2
    ops = decode_operands(g, H, D, lengths, rank or 8, S, bias=lb is not None)
    if rank is None:  # the kernel's f input: f = f_a f_b^T computed outside
        ops[7], ops[8] = ops[7] @ ops[8].T, None
    mine = [x.clone() if isinstance(x, torch.Tensor) else x for x in ops]
    want = [x.clone() if isinstance(x, torch.Tensor) else x for x in ops]
    out, conv, state, states, tails = kda_decode(*mine, scale=D ** -0.5, lower_bound=lb, norm_eps=1e-5,
                                                  keep_states=True, block_v=block_v, split=split,
                                                  prefetch=prefetch, early=block_v == D // split)
    y_ref, states_ref = _unfused(want, D ** -0.5, lb, 1e-5)
    assert conv is mine[6] and state is mine[12]
    assert_close_rel(out, y_ref, 1e-5, "fused decode output")
    assert_close_rel(state, want[12], 1e-5, "kda state pool")
    assert torch.equal(conv, want[6]), "conv state pool"
    others = [s for s in range(S) if s not in ops[15].tolist()]
    assert torch.equal(state[others], ops[12][others]) and torch.equal(conv[others], ops[6][others])
    assert_close_rel(states, states_ref, 1e-5, "per-token states")
    assert torch.equal(tails, _conv_tails(ops, lengths)), "per-token conv tails"
    q, k, v, qc, kc, vc, conv0 = ops[:7]  # the reference conv's own per-token tails (ir.ref keep_states)
    _, ref_tails = ref.causal_conv1d(torch.cat([q, k, v], 1), torch.cat([qc, kc, vc], 0), conv0.clone(), ops[15],
                                     ops[16], keep_states=True)
    assert torch.equal(ref_tails, tails), "ir.ref causal_conv1d keep_states tails"


def test_decode_template_drop_in():
    g = _gen(8)
    H, D, lengths = 2, 16, [1, 1, 1]
    ops = decode_operands(g, H, D, lengths, 16, 4)
    (t,) = DECODE_TEMPLATES
    attrs = {"heads": H, "head_dim": D, "scale": D ** -0.5, "lower_bound": -5.0, "l2_eps": 1e-6, "norm_eps": 1e-5,
             "batch_invariant": False}
    a = SimpleNamespace(operands=[x.clone() if isinstance(x, torch.Tensor) else x for x in ops])
    key = t.key_dims(a, attrs)
    assert key == {"H": H, "D": D, "T": 3, "R": 3} and t.supports(a, attrs, "cpu") is None
    out = t.launch(a, attrs, t.heuristic(key, "cpu"))
    assert len(out) == 3 and out[1] is a.operands[6] and out[2] is a.operands[12]
    want = [x.clone() if isinstance(x, torch.Tensor) else x for x in ops]
    y_ref, _ = _unfused(want, D ** -0.5, -5.0, 1e-5)
    assert_close_rel(out[0], y_ref, 1e-5, "template output")
    assert_close_rel(out[2], want[12], 1e-5, "template state")
    types = SimpleNamespace(operands=[TensorType.of("f32", ("T", 6))] + [None] * 8 + [TensorType.of("f32", (2,))]
                            + [None] * 7)
    assert "power of two" in t.supports(types, attrs, "cpu")


def test_interrupted_split_launch_leaves_no_arrivals_counted(monkeypatch):
    """Split-V programs count arrivals on a per-device buffer that each launch leaves zero. A launch cut
    short (the tuner's per-candidate time-out, an error) must reset it, or the next launch would apply the
    gated norm from the wrong program."""
    from codegen.triton import kda_decode as mod

    g = _gen(9)
    H, D, lengths = 2, 32, [1, 1]
    ops = decode_operands(g, H, D, lengths, 8, 4)

    class Interrupted(Exception):
        pass

    class CutShort:
        def __getitem__(self, grid):
            def launch(*args, **kw):
                args[-5].add_(1)  # some programs arrived (the counter buffer), then the launch was cut short
                raise Interrupted()
            return launch

    real = mod._kda_decode_kernel
    monkeypatch.setattr(mod, "_kda_decode_kernel", CutShort())
    with pytest.raises(Interrupted):
        kda_decode(*[x.clone() if isinstance(x, torch.Tensor) else x for x in ops], scale=D ** -0.5, lower_bound=-5.0,
                   norm_eps=1e-5, block_v=8, split=2)
    monkeypatch.setattr(mod, "_kda_decode_kernel", real)
    assert int(mod._counters(ops[0].device, len(lengths) * H).abs().sum()) == 0
    want = [x.clone() if isinstance(x, torch.Tensor) else x for x in ops]
    out = kda_decode(*[x.clone() if isinstance(x, torch.Tensor) else x for x in ops], scale=D ** -0.5,
                     lower_bound=-5.0, norm_eps=1e-5, block_v=8, split=2)[0]
    assert_close_rel(out, _unfused(want, D ** -0.5, -5.0, 1e-5)[0], 1e-5, "launch after an interrupted one")


@pytest.mark.parametrize("gate_mm,rank_block,split", [(True, 32, 1), (False, 16, 1), (False, 128, 2)])
def test_decode_gate_gemm_and_rank_blocks(gate_mm, rank_block, split):
    """f = f_a f_b^T as one GEMM before the kernel (GATE_MM), or per program in rank blocks of RB: the same
    outputs and states as the unfused sequence."""
    g = _gen(11)
    H, D, lengths = 2, 16, [1, 2, 1]
    ops = decode_operands(g, H, D, lengths, 40, 5)
    want = [x.clone() if isinstance(x, torch.Tensor) else x for x in ops]
    out, _, state = kda_decode(*[x.clone() if isinstance(x, torch.Tensor) else x for x in ops], scale=D ** -0.5,
                               lower_bound=-5.0, norm_eps=1e-5, block_v=8, gate_mm=gate_mm, rank_block=rank_block,
                               split=split)
    y_ref, _ = _unfused(want, D ** -0.5, -5.0, 1e-5)
    assert_close_rel(out, y_ref, 1e-5, f"output gate_mm={gate_mm} RB={rank_block}")
    assert_close_rel(state, want[12], 1e-5, f"states gate_mm={gate_mm} RB={rank_block}")


@pytest.mark.parametrize("H,D,rank,rank_block,split,bias", [
    (2, 16, 40, 16, 2, False),    # rank 40 in 3 masked blocks of 16, split 2, Kimi-Linear softplus gate
    (1, 64, 64, 128, 4, True),    # split 4, the whole rank in one block, K3 gate
])
def test_decode_dot_free_gate_gemv(H, D, rank, rank_block, split, bias):
    """GEMV (one token per request): f_c = sum_j f_b[c, j] f_a[j] as a multiply-and-sum instead of 16-row
    dots; the same outputs and states as the unfused sequence. Several tokens per request fall back to the dots."""
    g = _gen(12)
    lb = -5.0 if bias else None
    for lengths in ([1, 1, 1], [1, 3]):
        ops = decode_operands(g, H, D, lengths, rank, 5, bias=bias)
        want = [x.clone() if isinstance(x, torch.Tensor) else x for x in ops]
        out, _, state = kda_decode(*[x.clone() if isinstance(x, torch.Tensor) else x for x in ops], scale=D ** -0.5,
                                   lower_bound=lb, norm_eps=1e-5, block_v=8, rank_block=rank_block, split=split,
                                   gemv=True)
        y_ref, _ = _unfused(want, D ** -0.5, lb, 1e-5)
        assert_close_rel(out, y_ref, 1e-5, f"GEMV gate output, lengths {lengths}")
        assert_close_rel(state, want[12], 1e-5, f"GEMV gate states, lengths {lengths}")



@pytest.mark.parametrize("H,D,lengths,block_v,split,early", [
    (2, 32, [1, 1, 1], 8, 1, False),  # 4 blocks a program
    (1, 64, [1, 1], 32, 1, False),    # 2 blocks (the B=64 heuristic's shape)
    (2, 32, [1, 2, 1], 8, 2, False),  # split 2, 2 blocks each; a 2-token request walked one token a group
])
def test_decode_one_token_several_blocks(H, D, lengths, block_v, split, early):
    """One token a group (MAXT 1) over several state blocks: its k, q and decay broadcasts are made once, before
    the block walk; the same outputs and states as the unfused sequence."""
    g = _gen(14)
    ops = decode_operands(g, H, D, lengths, 24, len(lengths) + 1)
    want = [x.clone() if isinstance(x, torch.Tensor) else x for x in ops]
    out, _, state = kda_decode(*[x.clone() if isinstance(x, torch.Tensor) else x for x in ops], scale=D ** -0.5,
                               lower_bound=-5.0, norm_eps=1e-5, block_v=block_v, split=split, early=early, group=1)
    y_ref, _ = _unfused(want, D ** -0.5, -5.0, 1e-5)
    assert_close_rel(out, y_ref, 1e-5, "one-token output")
    assert_close_rel(state, want[12], 1e-5, "one-token state pool")
