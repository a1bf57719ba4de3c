"""MoE expert and tail kernels (codegen/triton/moe_grouped_gemm.py, _moe_tiles.py, moe_tail.py) vs the
references, in the Triton interpreter, fp32, tiny shapes.

The tile map (bound on the tile count, tiles only for experts with tokens); grouped expert GEMMs vs a
float64 reference (random, skewed, empty experts; dense and MXFP4 weights, the MXFP4 reference being the
float64 dequantisation; split-K; the MXFP4 tile decode); the fused LatentMoE tail vs the unfused
reference ops in sequence; k31-tiny through the fusion pass; batch invariance of router + experts + tail
(a token alone vs inside a batch, bitwise); heuristics vs constraints. The router and the token
permutation (moe_router.py) are checked in test_moe_router_kernels.py, the GPU-only paths (the PTX
decode, tl.dot_scaled) in test_moe_kernels_gpu_paths.py.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from codegen.registry import templates_for
from codegen.triton import _moe_tiles as tiles
from codegen.triton import moe_grouped_gemm as gg
from codegen.triton import moe_router as mr
from codegen.triton import moe_tail as mt
from ir.formats import quantize_mxfp4
from ir.ops import OPS
from ir.packed import PackedMXFP4
from ir.ref import moe as ref
from tests.helpers import assert_close_rel

E, L, I = 8, 64, 64


def _gen(seed):
    return torch.Generator().manual_seed(seed)


def _experts(g, e=E, ell=L, inter=I):
    w1 = torch.randn(e, inter, ell, generator=g) / ell ** 0.5
    w3 = torch.randn(e, inter, ell, generator=g) / ell ** 0.5
    w2 = torch.randn(e, ell, inter, generator=g) / inter ** 0.5
    return w1, w2, w3


def _mx(w):
    return PackedMXFP4(*quantize_mxfp4(w))


def _deq64(w):
    return w.dequantize(torch.float64) if isinstance(w, PackedMXFP4) else w.double()


def _routing(g, T, k, kind):
    """weights f32 [T, k] (positive), ids i64 [T, k] (distinct per token)."""
    if kind == "random":
        ids = torch.argsort(torch.rand(T, E, generator=g), dim=1)[:, :k]
    elif kind == "skewed":       # expert 0 in (nearly) every token, the rest mostly on expert 1..2
        ids = torch.stack([torch.tensor([0] + torch.randperm(E - 1, generator=g)[: k - 1].add(1).tolist())
                           if t % 5 else torch.randperm(E, generator=g)[:k] for t in range(T)])
    elif kind == "empty":        # experts 1, 4, 6 never chosen
        live = torch.tensor([0, 2, 3, 5, 7])
        ids = live[torch.argsort(torch.rand(T, len(live), generator=g), dim=1)[:, :k]]
    else:
        raise ValueError(kind)
    return torch.rand(T, k, generator=g) + 0.1, ids.to(torch.int64)


def _ref_experts(z, w, ids, w1, w2, w3, act, b1, b2):
    return ref.moe_experts(z.double(), w.double(), ids, _deq64(w1), _deq64(w2), _deq64(w3), act, b1, b2)


# ------------------------------------------------------------------------------------------- tiles
def test_tile_bound_is_tight():
    """max_tiles(P, E, BM) >= Σ_e ceil(c_e / BM) for random routings, and equal to it at T=1, top-2."""
    g = _gen(12)
    for P, ne, bm in ((2, 112, 16), (1024, 112, 16), (37, 8, 4), (5, 8, 16)):
        for _ in range(20):
            c = torch.bincount(torch.randint(0, ne, (P,), generator=g), minlength=ne)
            assert int(((c + bm - 1) // bm).sum()) <= gg.max_tiles(P, ne, bm)
    assert gg.max_tiles(2, 112, 16) == 2            # T=1, top-2: two tiles, no program without rows


def test_tiles_only_for_experts_with_tokens():
    """Program tid -> (expert, first row): tiles cover exactly the non-empty experts, none for empty ones."""
    import triton
    import triton.language as tl

    @triton.jit
    def probe(counts_ptr, offsets_ptr, out_ptr, E, E_PAD: tl.constexpr, BM: tl.constexpr):
        tid = tl.program_id(0)
        total, e, row0, m0, rows = tiles._locate_tile(counts_ptr, offsets_ptr, tid, E, E_PAD, BM)
        tl.store(out_ptr + tid * 4 + tl.arange(0, 4), tl.where(tl.arange(0, 4) == 0, total,
                 tl.where(tl.arange(0, 4) == 1, e, tl.where(tl.arange(0, 4) == 2, row0 + m0, rows))))

    counts = torch.tensor([0, 5, 0, 0, 17, 1, 0, 16], dtype=torch.int32)
    offsets = torch.cat([torch.zeros(1, dtype=torch.int32), counts.cumsum(0).to(torch.int32)])
    bm = 8
    slots = triton.cdiv(int(counts.sum()), bm) + E
    out = torch.zeros(slots, 4, dtype=torch.int32)
    probe[(slots,)](counts, offsets, out, E, E_PAD=8, BM=bm)
    total = int(out[0, 0])
    expect = [(e, int(offsets[e]) + m) for e in range(E) for m in range(0, int(counts[e]), bm)]
    assert total == len(expect) == 1 + 3 + 1 + 2
    assert [(int(r[1]), int(r[2])) for r in out[:total]] == expect
    assert all(int(r[3]) == counts[int(r[1])] for r in out[:total])


# ------------------------------------------------------------------------------------ expert GEMMs
EXPERT_CASES = [  # routing, k, act, beta1, beta2, weights, T
    ("random", 2, "situ", 4.0, 25.0, "dense", 21),
    ("skewed", 4, "situ", 4.0, 25.0, "dense", 40),
    ("empty", 3, "silu", None, None, "dense", 17),
    ("random", 4, "situ", None, None, "mxfp4", 19),
    ("skewed", 3, "silu", None, None, "mxfp4", 33),
    ("empty", 2, "situ", 4.0, 25.0, "mxfp4", 16),
]


@pytest.mark.parametrize("case", EXPERT_CASES)
def test_grouped_experts_vs_float64(case):
    kind, k, act, b1, b2, fmt, T = case
    g = _gen(100 + EXPERT_CASES.index(case))
    z = torch.randn(T, L, generator=g)
    w, ids = _routing(g, T, k, kind)
    w1, w2, w3 = _experts(g)
    if fmt == "mxfp4":
        w1, w2, w3 = _mx(w1), _mx(w2), _mx(w3)
    cfg = {"BM": 16, "BN": 32, "BK": 32, "BN2": 64, "BK2": 64} if kind == "skewed" else None  # several K/N steps
    y = gg.moe_experts(z, w, ids, w1, w2, w3, act, b1, b2, cfg)
    assert y.dtype == torch.float32 and y.shape == (T, L)
    assert_close_rel(y, _ref_experts(z, w, ids, w1, w2, w3, act, b1, b2), 1e-5, f"experts {case}")


SPLIT_CASES = [  # routing, k, T, weights, SPLIT, SPLIT2, act
    ("random", 2, 1, "mxfp4", 2, 2, "situ"),        # the rank preset's decode: 1 token, top-2
    ("skewed", 3, 5, "mxfp4", 4, 1, "situ"),        # 4 splits of 2 K steps: two of them empty
    ("empty", 2, 3, "dense", 3, 4, "silu"),         # splits need not be powers of two; SPLIT2 alone
]


@pytest.mark.parametrize("case", SPLIT_CASES)
def test_grouped_experts_split_k_vs_float64(case):
    """Split-K path: gate-up writes fp32 partials of W1 z and W3 z per split, a pass sums them and applies
    act; the down kernel's own splits are summed in the combine (fixed order)."""
    kind, k, T, fmt, split, split2, act = case
    g = _gen(500 + SPLIT_CASES.index(case))
    z = torch.randn(T, L, generator=g)
    w, ids = _routing(g, T, k, kind)
    w1, w2, w3 = _experts(g)
    if fmt == "mxfp4":
        w1, w2, w3 = _mx(w1), _mx(w2), _mx(w3)
    b1, b2 = (4.0, 25.0) if act == "situ" else (None, None)
    cfg = {"BM": 16, "BN": 32, "BK": 32, "BN2": 64, "BK2": 32, "SPLIT": split, "SPLIT2": split2,
           "DEQ": "bytes16" if fmt == "mxfp4" and split == 2 else "bytes"}
    o, seg = gg.expert_pair_outputs(z, ids, w1, w2, w3, act, b1, b2, cfg)
    assert o.shape == ((split2, T * k, L) if split2 > 1 else (T * k, L))
    y = gg.combine_pairs(o, w, ids, E)
    assert_close_rel(y, _ref_experts(z, w, ids, w1, w2, w3, act, b1, b2), 1e-5, f"split-K {case}")


def test_experts_template_drop_in_and_foreign_ids():
    """Template launch on operands bound like the IR op; ids outside [0, E) (other EP ranks) add 0."""
    (t,) = templates_for("moe_experts")
    op = OPS["moe_experts"]
    g = _gen(5)
    z = torch.randn(12, L, generator=g)
    w, ids = _routing(g, 12, 3, "random")
    w1, w2, w3 = _experts(g)
    w2 = _mx(w2)                                        # mixed formats: w1/w3 dense, w2 MXFP4
    attrs = op.full_attrs({"act": "situ", "beta1": 4.0, "beta2": 25.0})
    a = op.bind([z, w, ids, w1, w2, w3])
    assert t.supports(a, attrs) is None
    assert_close_rel(t.launch(a, attrs, None), _ref_experts(z, w, ids, w1, w2, w3, "situ", 4.0, 25.0), 1e-5, "drop-in")
    ids_f = ids.clone()
    ids_f[0, 1], ids_f[5, 0] = -1, E + 3
    y = t.launch(op.bind([z, w, ids_f, w1, w2, w3]), attrs, None)
    w_f = torch.where((ids_f >= 0) & (ids_f < E), w, torch.zeros_like(w))
    assert_close_rel(y, _ref_experts(z, w_f, ids_f.clamp(0, E - 1), w1, w2, w3, "situ", 4.0, 25.0), 1e-5, "foreign ids")


@pytest.mark.parametrize("words", [False, True])
def test_mxfp4_tile_is_exact_dequantisation(words):
    """Every byte value (two E2M1 codes) under scales 2^-127 .. 2^113 dequantises exactly, fp32 (the path
    the interpreter runs; the bf16 PTX decodes are emulated in test_moe_kernels_gpu_paths.py): bytes
    (DEQ bytes: even / odd columns) and 16-bit words (DEQ bytes16: columns 4j + c)."""
    import triton
    import triton.language as tl

    @triton.jit
    def probe(q_ptr, s_ptr, out_ptr, K, N: tl.constexpr, BK: tl.constexpr, WORDS: tl.constexpr):
        rn = tl.arange(0, N)
        for k0 in range(0, K, BK):
            s = tiles._step_scales(s_ptr, 0, rn, rn < N, k0, K, K // 32, N, BK, tiles._MX_BYTES, False)
            if WORDS:       # scales handed in (SL) / read inside (bytes)
                w0, w1, w2, w3 = tiles._mxfp4_quarters(q_ptr, s_ptr, 0, 0, rn, rn < N, k0, K, K // 4, K // 32, s, N,
                                                       BK, tl.float32, False, False, True, False)
                cols = k0 + 4 * tl.arange(0, BK // 4)[None, :]
                tl.store(out_ptr + rn[:, None] * K + cols, w0)
                tl.store(out_ptr + rn[:, None] * K + cols + 1, w1)
                tl.store(out_ptr + rn[:, None] * K + cols + 2, w2)
                tl.store(out_ptr + rn[:, None] * K + cols + 3, w3)
            else:
                even, odd = tiles._mxfp4_halves(q_ptr, s_ptr, 0, 0, rn, rn < N, k0, K, K // 2, K // 32, s, N, BK,
                                                tl.float32, False, False, False, False)
                cols = k0 + 2 * tl.arange(0, BK // 2)[None, :]
                tl.store(out_ptr + rn[:, None] * K + cols, even)
                tl.store(out_ptr + rn[:, None] * K + cols + 1, odd)

    N, K = 16, 256
    packed = torch.arange(N * K // 2).remainder(256).to(torch.uint8).reshape(N, K // 2)
    packed = packed[:, torch.randperm(K // 2, generator=_gen(4))].contiguous()   # every byte in every slot
    pool = torch.tensor([0, 1, 20, 60, 100, 118, 126, 127, 128, 131, 140, 200, 240] * 10, dtype=torch.uint8)
    scales = pool[torch.randperm(len(pool), generator=_gen(3))][: N * K // 32].reshape(N, K // 32)
    out = torch.full((N, K), float("nan"))
    probe[(1,)](packed.view(torch.int16) if words else packed, scales, out, K, N=N, BK=128, WORDS=words)
    assert torch.equal(out.double(), PackedMXFP4(packed, scales).dequantize(torch.float64))


@pytest.mark.parametrize("deq,bk,sl", [("bytes", 128, 0), ("bytes16", 64, 1), ("bytes16", 64, 2), ("bytes", 128, 3),
                                       ("bytes16", 128, 2)])
def test_grouped_experts_mxfp4_k_tile_of_four_blocks(deq, bk, sl):
    """ℓ = I = 128 with BK = 128 (four MXFP4 blocks per K step) or 64, skewed routing, SiTU-GLU; bytes16
    reads the packed weights as int16 (columns 4j + c, the layout of the GPU's asm16 decode). Scale reads
    (SL): 0 inside the step, 1 bytes at its top, 2 int32 words of four bytes (BK=64: a word serves two
    steps), 3 bytes loaded a step ahead."""
    g = _gen(401)
    T, k, ell = 24, 3, 128
    z = torch.randn(T, ell, generator=g)
    w, ids = _routing(g, T, k, "skewed")
    w1, w2, w3 = (_mx(x) for x in _experts(g, ell=ell, inter=ell))
    cfg = {"BM": 16, "BN": 64, "BK": bk, "BN2": 64, "BK2": bk, "DEQ": deq, "SL": sl}
    y = gg.moe_experts(z, w, ids, w1, w2, w3, "situ", 4.0, 25.0, cfg)
    assert_close_rel(y, _ref_experts(z, w, ids, w1, w2, w3, "situ", 4.0, 25.0), 1e-5, f"experts {deq} BK={bk} SL={sl}")


def test_grouped_experts_mxfp4_16bit_words_fall_back_on_odd_storage():
    """DEQ bytes16 needs the packed bytes 2-byte aligned: a view starting at an odd byte falls back to the
    byte decode (same result)."""
    g = _gen(402)
    T, k = 9, 2
    z = torch.randn(T, L, generator=g)
    w, ids = _routing(g, T, k, "random")
    w1, w2, w3 = (_mx(x) for x in _experts(g))
    buf = torch.empty(w2.packed.numel() + 1, dtype=torch.uint8)
    buf[1:] = w2.packed.reshape(-1)
    odd = PackedMXFP4(buf[1:].view(w2.packed.shape), w2.scales)           # starts at an odd address
    assert gg._int16_view(odd.packed) is None and gg._int16_view(w1.packed) is not None
    cfg = {"BM": 16, "BN": 64, "BK": 64, "BN2": 64, "BK2": 64, "DEQ": "bytes16"}
    y = gg.moe_experts(z, w, ids, w1, odd, w3, "silu", None, None, cfg)
    assert_close_rel(y, _ref_experts(z, w, ids, w1, w2, w3, "silu", None, None), 1e-5, "bytes16 fallback")


# ------------------------------------------------------------------------------------ fused tail
def _ref_op(name, xs, at):
    """One unfused reference op (float64 operands)."""
    op = OPS[name]
    return op.reference(op.bind(xs), op.full_attrs(at))


@pytest.mark.parametrize("T", [1, 13])
def test_latent_moe_tail_vs_unfused_ops(T):
    """fused.latent_moe_tail(y, norm_w, w_up, shared) vs rms_norm -> cast -> linear -> add."""
    g = _gen(300 + T)
    D, eps = 48, 1e-5
    y = torch.randn(T, L, generator=g) * 3
    nw, up = 1 + 0.3 * torch.randn(L, generator=g), torch.randn(D, L, generator=g) / L ** 0.5
    shared = torch.randn(T, D, generator=g)
    (t,) = templates_for(mt.TAIL_OP)
    attrs = {"eps": eps, "dtype": "bf16"}
    a = SimpleNamespace(operands=[y, nw, up, shared])
    assert t.supports(a, attrs) is None
    got = t.launch(a, attrs, t.heuristic(t.bucket(t.key_dims(a, attrs))))
    yn = _ref_op("cast", [_ref_op("rms_norm", [y.double(), nw.double()], {"eps": eps})], {"dtype": "bf16"})
    exp = _ref_op("add", [_ref_op("linear", [yn, up.double()], {}), shared.double()], {})
    assert got.shape == (T, D) and got.dtype == shared.dtype
    assert_close_rel(got, exp, 1e-5, f"tail T={T}")


def test_templates_accept_compile_time_types():
    """supports() runs at compile time on TensorTypes (dtype + symbolic shape) and a target name."""
    from ir.core import TensorType
    (te,) = templates_for("moe_experts")
    (tt,) = templates_for(mt.TAIL_OP)
    ty = lambda dt, *dims: TensorType.of(dt, dims)  # noqa: E731
    op = OPS["moe_experts"]
    a = op.bind([ty("bf16", "B", 128), ty("f32", "B", 4), ty("i64", "B", 4), ty("mxfp4", 16, 64, 128),
                 ty("mxfp4", 16, 128, 64), ty("mxfp4", 16, 64, 128)])
    assert te.supports(a, op.full_attrs({"act": "situ"}), "h200") is None
    assert te.supports(a, op.full_attrs({"act": "gelu"}), "h200") is not None
    tail = SimpleNamespace(operands=[ty("f32", "B", 128), ty("bf16", 128), ty("bf16", 256, 128), ty("bf16", "B", 256)])
    assert tt.supports(tail, {"eps": 1e-5, "dtype": "bf16"}, "h200") is None
    assert gg.target_cc("h200") == 90 and gg.target_cc("b200") == 100 and gg.target_cc("cpu") is None


def test_tiny_model_through_the_fusion_pass_and_kernels():
    """k31-tiny with MXFP4 experts: the latent_moe_tail pass fires per MoE layer and the compiled
    executor (router, expert and tail kernels; reference for everything else) matches the reference."""
    from dataclasses import replace

    from codegen.select import Choice
    from k31c.model.build import build_module
    from k31c.model.init_weights import random_weights
    from k31c.model.presets import get_preset
    from k31c.runtime.executor import Executor
    from k31c.runtime.reference import ReferenceRuntime
    from passes import latent_moe_tail
    from passes.base import PassContext

    cfg = replace(get_preset("k31-tiny"), experts_format="mxfp4")
    weights = random_weights(cfg, 3)
    fused = build_module(cfg)
    fired = latent_moe_tail.run(fused, PassContext())
    moe_layers = sum(cfg.is_moe_layer(i) for i in range(cfg.num_hidden_layers))
    assert fired == moe_layers * len(fused.functions)
    ops = ("moe_router", "moe_experts", mt.TAIL_OP)
    choices = [Choice(fname, i, n.op, "", templates_for(n.op)[0]) for fname, fn in fused.functions.items()
               for i, n in enumerate(fn.nodes) if n.op in ops]
    engine = Executor(fused, weights, choices, target="cpu")
    tokens = torch.randint(0, cfg.vocab_size, (6,), generator=_gen(9)).tolist()
    logits = []
    for module, eng in ((fused, engine), (build_module(cfg), None)):
        rt = ReferenceRuntime(module, weights, max_rows=64, max_requests=2, engine=eng)
        rt.add_request("r", 16)
        logits.append(rt.prefill({"r": tokens}))
    assert engine.calls["moe_latent_tail"] == moe_layers and engine.calls["moe_grouped_gemm"] == moe_layers
    assert_close_rel(logits[0], logits[1], 1e-4, "tiny model logits")
    # the kernels took the experts packed: no widened copy of an MXFP4 weight is cached (on k31-pro shares
    # that copy was 2-4x the packed bytes of every expert)
    packed = {n for n, w in weights.items() if isinstance(w, PackedMXFP4)}
    assert packed and not packed & set(engine._params), sorted(packed & set(engine._params))[:3]


# ----------------------------------------------------------------------------- batch invariance
def test_batch_invariance_bitwise():
    """With batch_invariant, token i's result alone equals its row inside a batch (tokens i .. T-1), bit for bit.
    The token leads the batch, so each of its pairs is the first row of its expert's tile in both runs: the
    interpreter's tl.dot is numpy's matmul, whose fp32 rounding of a column depends on the column's position (moved
    to column 0, 48 of 64 columns of a random 64x64 product differ in the last bit, numpy 2.4), unlike an MMA."""
    g = _gen(77)
    T, k, D, i = 48, 4, 32, 29
    z = torch.randn(T, L, generator=g)
    logits = torch.randn(T, E, generator=g)
    w1, w2, w3 = _experts(g)
    w2 = _mx(w2)
    up, shared, nw = torch.randn(D, L, generator=g) / 8, torch.randn(T, D, generator=g), 1 + torch.rand(L, generator=g)
    (te,) = templates_for("moe_experts")
    (tt,) = templates_for(mt.TAIL_OP)
    op = OPS["moe_experts"]
    ex_attrs = {**op.full_attrs({"act": "situ", "beta1": 4.0, "beta2": 25.0}), "batch_invariant": True}
    tail_attrs = {"eps": 1e-5, "dtype": "bf16", "batch_invariant": True}
    keys = [te.bucket(te.key_dims(op.bind([z[:n], logits[:n, :k], logits[:n, :k].long(), w1, w2, w3]), ex_attrs))
            for n in (1, T)]
    assert keys[0] == keys[1], "batch-invariant keys must not depend on T"
    outs = {}
    for name, rows in (("alone", slice(i, i + 1)), ("batch", slice(i, T))):
        w, ids = mr.router(logits[rows], None, k, "sigmoid", True, 1.0)
        y = te.launch(op.bind([z[rows], w, ids, w1, w2, w3]), ex_attrs, None)
        o = tt.launch(SimpleNamespace(operands=[y, nw, up, shared[rows]]), tail_attrs, None)
        outs[name] = (w, ids, y, o)
    a, b = outs["alone"], outs["batch"]
    for x, yb, what in zip(a, b, ("router weights", "ids", "experts", "tail")):
        assert torch.equal(x[0], yb[0]), f"{what}: token alone differs from the same token in a batch"
    assert te.heuristic({**keys[0], "T": 1})["BM"] == te.heuristic({**keys[0], "T": 4096})["BM"]


# ------------------------------------------------------------------------------- templates, AOT
def test_heuristics_satisfy_constraints_at_model_shapes():
    (te,) = templates_for("moe_experts")
    (tt,) = templates_for(mt.TAIL_OP)
    h200, b200 = {"compute_capability": (9, 0)}, {"compute_capability": (10, 0)}
    for T in (1, 64, 8192):
        for bi in (0, 1):
            key = {"T": T, "E": 112, "K": 16, "L": 3584, "I": 3072, "MX": 1, "BF16": 1, "BI": bi}
            for tgt in (h200, b200):
                cfg = te.heuristic(te.bucket(key), tgt)
                assert te.constraints(cfg, key, tgt) == [], (key, cfg)
                tkey = {"T": T, "L": 3584, "D": 7168, "BF16": 1, "BI": bi}
                tcfg = tt.heuristic(tt.bucket(tkey), tgt)
                assert tt.constraints(tcfg, tkey, tgt) == [], (tkey, tcfg)
                # bf16 activations: the PTX decode on Hopper; Blackwell's tcgen05 needs shared-memory
                # operands, so there tl.dot_scaled (register operands would fall back to FMA dots)
                # (T=64: its grid fills the GPU, DECODE_T64's asm16i, the left shifts as multiplies)
                dec = ("asm16i" if T == 64 else "asm16") if T * 16 / 112 <= 16 and not bi else "asm"
                assert cfg["DEQ"] == (dec if tgt is h200 else "dot_scaled"), (key, cfg)
            cpu = te.heuristic(te.bucket(key), {"compute_capability": None})
            assert cpu["DEQ"] == "bytes" and te.constraints(cpu, key, None) == []
    assert te.constraints({**cfg, "DEQ": "dot_scaled"}, {**key, "BF16": 0}, h200)
    # measured on the H200: T=1 top-2 runs the dot-free path (test_moe_gemv.py); the grouped path there
    # would split K 4 ways (2 tiles x 48 column blocks leave SMs idle); T=64 top-16 fills the GPU for many
    # waves: no split, register cap
    key1 = {"T": 1, "E": 112, "K": 2, "L": 3584, "I": 3072, "MX": 1, "BF16": 1, "BI": 0}
    c1, c64 = te.heuristic(te.bucket(key1), h200), te.heuristic(te.bucket({**key1, "T": 64, "K": 16}), h200)
    assert c1["PATH"] == "gemv" and c64["PATH"] == "grouped" and gg.decode_split(2 * 48, 28) == 4
    assert c64["SPLIT"] == 1 and "MAXNREG" not in c1 and all(c64[k] == v for k, v in gg.DECODE_T64.items())
    assert c64["MAXNREG2"] != c64["MAXNREG"] and c64["BN2"] == 64      # the down kernel's own cap and tiles
    assert te.heuristic(te.bucket(key1), {"compute_capability": None})["SPLIT"] == 1  # the interpreter: no split
    assert te.constraints({**c1, "SPLIT": 4}, key1, h200) == []
    bi = {**key1, "BI": 1}
    assert te.heuristic(te.bucket(bi), h200)["SPLIT"] == 1
    assert te.constraints({**te.heuristic(bi, h200), "SPLIT": 4}, bi, h200)
    name = te.kernel_name(te.heuristic(te.bucket(key), h200), te.bucket(key))
    assert name.startswith("moe_grouped_gemm_") and "BM" in name and "MX1" in name
