"""Dot-free decode path of the routed experts (codegen/triton/_moe_gemv.py, moe_experts PATH="gemv") in the
Triton interpreter, fp32, tiny shapes: vs a float64 reference on random, skewed and empty-expert routing
(dense and MXFP4 weights, the MXFP4 reference being the float64 dequantisation), foreign expert ids,
every E2M1 code of the word decode, scale bytes far from 1, batch invariance, the heuristic's choice and
the fall-back to the grouped path when packed bytes cannot be read as int32 words; the GV=2 kernels (4-word
scale groups, prefetch, fp32 word-major h, down split by slot with the in-launch combine) likewise."""

from __future__ import annotations

import pytest
import torch
import triton
import triton.language as tl

from codegen.registry import templates_for
from codegen.triton._gemv import tile_counters
from codegen.triton import _moe_gemv as gv
from codegen.triton import _moe_gemv_words as gvw
from codegen.triton import moe_grouped_gemm as gg
from ir.formats import quantize_mxfp4
from ir.ops import OPS
from ir.packed import PackedMXFP4
from ir.ref import moe as ref
from tests.helpers import assert_close_rel

E, L, I = 8, 64, 96


def _experts(g, fmt):
    w1 = torch.randn(E, I, L, generator=g) / L ** 0.5
    w3 = torch.randn(E, I, L, generator=g) / L ** 0.5
    w2 = torch.randn(E, L, I, generator=g) / I ** 0.5
    if fmt == "mxfp4":
        return tuple(PackedMXFP4(*quantize_mxfp4(w)) for w in (w1, w2, w3))
    return w1, w2, w3


def _deq64(w):
    return w.dequantize(torch.float64) if isinstance(w, PackedMXFP4) else w.double()


def _ref(z, w, ids, w1, w2, w3, act, b1, b2):
    keep = (ids >= 0) & (ids < E)
    w = torch.where(keep, w, torch.zeros_like(w)).double()
    return ref.moe_experts(z.double(), w, ids.clamp(0, E - 1), _deq64(w1), _deq64(w2), _deq64(w3), act, b1, b2)


def _routing(g, T, k, kind):
    if kind == "random":
        ids = torch.argsort(torch.rand(T, E, generator=g), dim=1)[:, :k]
    elif kind == "skewed":       # expert 3 in every token
        ids = torch.stack([torch.cat([torch.tensor([3]), torch.randperm(E - 1, generator=g)[: k - 1].add(4) % E])
                           for _ in range(T)])
    else:                        # "empty": experts 1, 4, 6 never chosen
        live = torch.tensor([0, 2, 3, 5, 7])
        ids = live[torch.argsort(torch.rand(T, len(live), generator=g), dim=1)[:, :k]]
    return torch.rand(T, k, generator=g) + 0.1, ids.to(torch.int64)


CASES = [  # routing, T, k, weights, act, GK (K columns a step), GN, GMMA (tensor-core inner product), GPROG
    ("random", 1, 2, "mxfp4", "situ", 512, 16, 0, 0),    # the rank preset's decode: 1 token, top-2
    ("skewed", 3, 3, "mxfp4", "silu", 32, 32, 0, 0),     # several K steps; I = 96: a partial row block
    ("empty", 2, 2, "dense", "situ", 16, 64, 0, 0),
    ("random", 2, 4, "dense", "silu", 64, 16, 0, 5),     # 5 programs stride over 48 + 8 tiles
    ("random", 1, 2, "mxfp4", "situ", 64, 16, 1, 0),     # MMA step, 16-bit-word decode (bytes16 here)
    ("skewed", 2, 3, "mxfp4", "silu", 64, 32, 1, 3),
    ("empty", 2, 2, "dense", "situ", 32, 64, 1, 0),
]


@pytest.mark.parametrize("case", CASES)
def test_gemv_experts_vs_float64(case):
    kind, T, k, fmt, act, gk, gn, mma, progs = case
    g = torch.Generator().manual_seed(1000 + CASES.index(case))
    z = torch.randn(T, L, generator=g)
    w, ids = _routing(g, T, k, kind)
    w1, w2, w3 = _experts(g, fmt)
    b1, b2 = (4.0, 25.0) if act == "situ" else (None, None)
    cfg = {"PATH": "gemv", "GN": gn, "GK": gk, "GN2": gn, "GK2": gk, "GMMA": mma, "GPROG": progs}
    y = gg.moe_experts(z, w, ids, w1, w2, w3, act, b1, b2, cfg)
    assert y.dtype == torch.float32 and y.shape == (T, L)
    assert_close_rel(y, _ref(z, w, ids, w1, w2, w3, act, b1, b2), 1e-5, f"gemv {case}")


V2_CASES = [  # routing, T, k, act, GN, GK, GN2, GK2, PREF, XV, HX, warps: the GV=2 kernels (MXFP4 words only)
    ("random", 1, 2, "situ", 4, 64, 8, 64, 1, 1, 1, 2),     # the T=1 heuristic's shape of tiles; I=96: K not tiled
    ("skewed", 3, 3, "silu", 8, 32, 16, 32, 0, 0, 0, 4),    # several steps, no prefetch, 2-byte loads, bf16 h
    ("empty", 2, 2, "situ", 16, 128, 4, 64, 1, 0, 1, 1),    # experts without tokens; GK halved to K
    ("random", 2, 1, "situ", 8, 64, 8, 64, 1, 1, 1, 4),     # one slot: y stored without the in-launch combine
]


def _v2_cfg(gn, gk, gn2, gk2, pref, xv, hx, warps):
    return {"PATH": "gemv", "GV": 2, "GN": gn, "GK": gk, "GN2": gn2, "GK2": gk2, "PREF": pref, "XV": xv, "HX": hx,
            "num_warps": warps, "GW2": warps}


@pytest.mark.parametrize("case", V2_CASES)
def test_gemv_v2_vs_float64(case):
    """GV=2: 4-word scale groups, the next step's words loaded ahead, h as fp32 words, down split by slot and
    combined in the launch by the last slot to arrive; the arrival counters are left at 0."""
    kind, T, k, act, *tiles = case
    g = torch.Generator().manual_seed(2000 + V2_CASES.index(case))
    z = torch.randn(T, L, generator=g)
    w, ids = _routing(g, T, k, kind)
    w1, w2, w3 = _experts(g, "mxfp4")
    b1, b2 = (4.0, 25.0) if act == "situ" else (None, None)
    y = gg.moe_experts(z, w, ids, w1, w2, w3, act, b1, b2, _v2_cfg(*tiles))
    assert y.dtype == torch.float32 and y.shape == (T, L)
    assert_close_rel(y, _ref(z, w, ids, w1, w2, w3, act, b1, b2), 1e-5, f"gemv v2 {case}")
    assert not tile_counters(z.device, 1).any(), "GV=2 left an arrival counter set"


def test_gemv_foreign_ids_add_nothing():
    """ids outside [0, E) (experts of other EP ranks): their pairs are skipped in both kernels."""
    g = torch.Generator().manual_seed(7)
    z = torch.randn(3, L, generator=g)
    w, ids = _routing(g, 3, 2, "random")
    ids[0, 1], ids[2, 0] = -1, E + 2
    w1, w2, w3 = _experts(g, "mxfp4")
    for gv2 in (1, 2):      # GV=2: a foreign slot still counts itself in, so its token's combine happens
        y = gg.moe_experts(z, w, ids, w1, w2, w3, "situ", 4.0, 25.0, {"PATH": "gemv", "GV": gv2, "GK": 32, "GK2": 32})
        assert_close_rel(y, _ref(z, w, ids, w1, w2, w3, "situ", 4.0, 25.0), 1e-5, f"foreign ids GV={gv2}")


def test_gemv_v2_early_reads_match_and_skip_foreign_ids():
    """EARLY (expert id and step 0's weights read before the PDL wait: bit 0 down, bit 1 gate-up) and a register
    cap (GREG, ignored off CUDA) change no value: bitwise equal to EARLY=0, foreign ids (another rank's experts,
    masked in the early loads) add nothing; the arrival counters are left at 0."""
    g = torch.Generator().manual_seed(17)
    z = torch.randn(2, L, generator=g)
    w, ids = _routing(g, 2, 2, "skewed")
    ids[1, 0] = E + 5
    ws = _experts(g, "mxfp4")
    base = {**_v2_cfg(8, 32, 16, 64, 1, 1, 1, 2), "GN": 32}
    want = gg.moe_experts(z, w, ids, *ws, "situ", 4.0, 25.0, base)
    assert_close_rel(want, _ref(z, w, ids, *ws, "situ", 4.0, 25.0), 1e-5, "gemv v2 EARLY=0")
    for early in (1, 3):
        y = gg.moe_experts(z, w, ids, *ws, "situ", 4.0, 25.0, {**base, "EARLY": early, "GREG": 128})
        assert torch.equal(y, want), f"EARLY={early} changed the result"
    for late in (1, 0):  # the gate-up launched without its programmatic edge (LATE; also through the override)
        y = gg.moe_experts(z, w, ids, *ws, "situ", 4.0, 25.0, {**base, "EARLY": 3, "LATE": late})
        before = gvw.set_late_override(1 - late)
        try:
            y2 = gg.moe_experts(z, w, ids, *ws, "situ", 4.0, 25.0, {**base, "LATE": late})
        finally:
            gvw.set_late_override(before)
        assert torch.equal(y, want) and torch.equal(y2, want), f"LATE={late} changed the result"
    assert not tile_counters(z.device, 1).any(), "GV=2 EARLY left an arrival counter set"


@triton.jit
def _decode_words_kernel(w_ptr, out_ptr, N: tl.constexpr):
    w = tl.load(w_ptr + tl.arange(0, N))
    for c in tl.static_range(4):
        lo, hi = gv._code_pair(w, c)
        tl.store(out_ptr + tl.arange(0, N) * 8 + c, lo)
        tl.store(out_ptr + tl.arange(0, N) * 8 + c + 4, hi)


def test_word_decode_is_exact_for_every_code():
    """Every 16-bit half pattern (all four codes of a half) in both halves of a word: E2M1 · 2^-14."""
    lo = torch.arange(1 << 16, dtype=torch.int64)
    hi = torch.flip(lo, [0])
    words = (lo | (hi << 16)).to(torch.int64)
    words = torch.where(words >= 1 << 31, words - (1 << 32), words).to(torch.int32)
    out = torch.empty(words.numel() * 8, dtype=torch.float32)
    _decode_words_kernel[(1,)](words, out, N=words.numel())
    packed = words.view(torch.uint8).view(-1, 32)          # 8 words = 64 codes = one row of 2 blocks
    expect = PackedMXFP4(packed, torch.full((packed.shape[0], 2), 127, dtype=torch.uint8)).dequantize(torch.float64)
    assert torch.equal(out.double().view(-1, 64) * 2.0 ** 14, expect)


def test_gemv_scale_bytes_far_from_one():
    """Block scales 2^-27 .. 2^13 (bytes 100 .. 140): the factor s << 23 is exact over the range."""
    g = torch.Generator().manual_seed(9)
    z = torch.randn(2, L, generator=g)
    w, ids = _routing(g, 2, 2, "random")
    ws = _experts(g, "mxfp4")
    ws = tuple(PackedMXFP4(x.packed, torch.randint(100, 141, x.scales.shape, generator=g, dtype=torch.uint8))
               for x in ws)
    for gv2 in (1, 2):
        y = gg.moe_experts(z, w, ids, *ws, "silu", None, None, {"PATH": "gemv", "GV": gv2, "GK": 32, "GK2": 64})
        assert_close_rel(y, _ref(z, w, ids, *ws, "silu", None, None), 1e-5, f"wide scales GV={gv2}")


def test_gemv_token_alone_equals_token_in_batch():
    g = torch.Generator().manual_seed(11)
    z = torch.randn(4, L, generator=g)
    w, ids = _routing(g, 4, 2, "random")
    ws = _experts(g, "mxfp4")
    for mma, gv2 in ((0, 1), (1, 1), (0, 2)):    # a fixed config (the heuristic's depends on T): every kernel pair
        cfg = {"PATH": "gemv", "GV": gv2, "GMMA": mma, "GN": 16, "GK": 64, "GN2": 16, "GK2": 64, "num_warps": 4}
        batch = gg.moe_experts(z, w, ids, *ws, "situ", 4.0, 25.0, cfg)
        alone = gg.moe_experts(z[2:3], w[2:3], ids[2:3], *ws, "situ", 4.0, 25.0, cfg)
        assert torch.equal(alone[0], batch[2]), f"GMMA={mma} GV={gv2}"


def test_heuristic_picks_gemv_for_few_pairs_and_falls_back_on_odd_storage():
    (te,) = templates_for("moe_experts")
    h200 = {"compute_capability": (9, 0)}
    key = {"T": 1, "E": 112, "K": 2, "L": 3584, "I": 3072, "MX": 1, "BF16": 1, "BI": 0}
    for tgt in (h200, None):
        cfg = te.heuristic(te.bucket(key), tgt)
        assert cfg["PATH"] == "gemv" and cfg["GV"] == 2 and cfg["GMMA"] == 0 and te.constraints(cfg, key, tgt) == [], cfg
        cfg8 = te.heuristic(te.bucket({**key, "T": 8}), tgt)       # 16 pairs (H200: 168.3 us vs the MMA step's 204)
        assert cfg8["PATH"] == "gemv" and cfg8["GV"] == 2 and te.constraints(cfg8, key, tgt) == [], cfg8
    # on the H200 the measured tiles (4 x 1024 on 2 warps, down 8 x 1024 on 1: T=1 27.7 us, T=8 168.3 us); at T=1
    # the down kernel's steps chosen inside the decode graph, beside the Gluon gate-up (session 18)
    from codegen.triton._moe_gemv_gluon import GLUON_T1, GLUON_T1_DOWN
    for t, want in ((1, {**gg.GEMV_T1, **GLUON_T1_DOWN}), (8, gg.GEMV_T1)):
        assert {k: te.heuristic(te.bucket({**key, "T": t}), h200)[k] for k in gg.GEMV_T1} == want
    assert {k: te.heuristic(te.bucket(key), h200)[k] for k in GLUON_T1} == GLUON_T1
    assert te.heuristic(te.bucket(key), h200)["GASM"] == 1 and te.constraints({**cfg, "GASM": 1}, key, None)
    assert te.heuristic(te.bucket({**key, "T": 64, "K": 16}), h200)["PATH"] == "grouped"
    bi = {**key, "BI": 1}
    assert te.heuristic(te.bucket(bi), h200)["PATH"] == "grouped"
    assert te.constraints({**te.heuristic(bi, h200), "PATH": "gemv"}, bi, h200)
    # packed bytes at an odd offset cannot be read as int32 words: the op runs the grouped path instead
    g = torch.Generator().manual_seed(13)
    z = torch.randn(1, L, generator=g)
    w, ids = _routing(g, 1, 2, "random")
    w1, w2, w3 = _experts(g, "mxfp4")
    store = torch.empty(w2.packed.numel() + 1, dtype=torch.uint8)
    store[1:] = w2.packed.reshape(-1)
    odd = PackedMXFP4(store[1:].view(w2.packed.shape), w2.scales)
    assert not gv.gemv_supported(w1, odd, w3)
    op = OPS["moe_experts"]
    attrs = op.full_attrs({"act": "silu"})
    y = te.launch(op.bind([z, w, ids, w1, odd, w3]), attrs, {"PATH": "gemv", "DEQ": "bytes"})
    assert_close_rel(y, _ref(z, w, ids, w1, w2, w3, "silu", None, None), 1e-5, "fall-back")
