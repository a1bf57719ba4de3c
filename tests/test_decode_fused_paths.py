"""The decode (T = 1 / small T) paths of the decode step's small fused kernels (issue 7), vs the ops'
unfused bodies or float64 formulas: AttnRes mix with prefetched bank rows (codegen/triton/attn_res.py),
the one-launch GEMV latent-MoE tail (moe_tail.py), the one-launch split indexer front with its arrival
counters (indexer_front.py; the one-token kernel with preloaded weights and the Kronecker-form rotations in
_indexer_front_decode.py), and the one-token value gate (value_gate.py). CPU: Triton interpreter, fp32, tiny
shapes."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from codegen.triton import attn_res
from codegen.triton import moe_tail as mt
from codegen.triton import norm_quant as nq
from codegen.triton import indexer_front as fr
from ir import formats
from ir.core import Module
from ir.interpreter import Interpreter
from ir.ref import basic as ref
from tests.helpers import assert_close_rel
from tests.test_norm_kernels import _front_node, _front_operands


# ------------------------------------------------------------------------------------------ attn_res
@pytest.mark.parametrize("prefetch", [0, 2, 4])
def test_attn_res_prefetched_bank_rows(prefetch):
    """5 bank rows + prefix add + norm, PREFETCH of them loaded up front: same as the float64 formula."""
    g = torch.Generator().manual_seed(20 + prefetch)
    T, d, n = 3, 72, 5
    bank = [torch.randn(T, d, generator=g) * (1 + 0.3 * i) for i in range(n)]
    last, part = torch.randn(T, d, generator=g), torch.randn(T, d, generator=g)
    proj, mnorm, gain = torch.randn(d, generator=g), torch.randn(d, generator=g), 1 + 0.2 * torch.randn(d, generator=g)
    cfg = {"BLOCK_R": 2, "BLOCK_D": 128, "num_warps": 4, "PREFETCH": prefetch}
    prefix, x, h = attn_res.attn_res_mix(bank, last, proj, mnorm, 1e-5, cfg, part=part, norm_weight=gain,
                                         norm_eps=1e-6)
    assert x is None
    p64 = last.double() + part.double()
    mix = ref.attn_res_mix([b.double() for b in bank] + [p64], proj.double(), mnorm.double(), 1e-5)
    assert_close_rel(prefix, p64, 1e-6, "prefix")
    assert_close_rel(h, ref.rms_norm(mix, gain.double(), 1e-6), 1e-5, f"h (PREFETCH={prefetch})")


def test_attn_res_heuristic_prefetches_at_decode_width():
    cfg = attn_res.heuristic({"T": 8, "d": 7168, "n": 4, "bi": 0}, "h200")
    assert cfg["num_warps"] == 8 and cfg["PREFETCH"] == 2  # the H200's best at d=7168 (bank 2: 4.17 µs)
    assert not attn_res.constraints(cfg, {"T": 8, "d": 7168, "n": 4}, "h200")
    one = attn_res.heuristic({"T": 1, "d": 7168, "n": 4, "bi": 0}, "h200")  # a one-token step: 16 warps (in-graph)
    assert one == {**cfg, "num_warps": 16} and not attn_res.constraints(one, {"T": 1, "d": 7168, "n": 4}, "h200")
    cpu = [attn_res.heuristic({"T": t, "d": 7168, "n": 4, "bi": 0}, "cpu") for t in (1, 8)]
    assert cpu[0] == cpu[1]  # the one-token rule is the GPU's
    assert attn_res.constraints({**cfg, "BLOCK_R": 16, "BLOCK_D": 8192, "num_warps": 4, "PREFETCH": 4},
                                {"d": 7168}, "h200")


# ------------------------------------------------------------------------------------- latent tail
@pytest.mark.parametrize("T", [1, 3])
def test_latent_tail_gemv_path(T):
    """U_GEMV=1 (the T = 1 decode path; any T runs, one grid row per token) vs rms_norm -> linear -> add,
    with ℓ not a multiple of G_BK and d not a multiple of G_BN (masked tails)."""
    g = torch.Generator().manual_seed(40 + T)
    L, D, eps = 100, 40, 1e-5
    y = torch.randn(T, L, generator=g) * 3
    nw, up = 1 + 0.3 * torch.randn(L, generator=g), torch.randn(D, L, generator=g) / L ** 0.5
    shared = torch.randn(T, D, generator=g)
    cfg = {**mt.heuristic({"T": 1, "L": L, "D": D, "BF16": 0, "BI": 0}), "G_BN": 16, "G_BK": 32, "G_warps": 4}
    assert cfg["U_GEMV"] == 1
    got = mt.latent_tail(y, nw, up, shared, eps, cfg)
    want = ref.rms_norm(y.double(), nw.double(), eps) @ up.double().T + shared.double()
    assert_close_rel(got, want, 1e-5, f"gemv tail T={T}")


def test_latent_tail_gemv_only_at_one_token():
    key = {"T": 1, "L": 3584, "D": 7168, "BF16": 1, "BI": 0}
    assert mt.heuristic(key)["U_GEMV"] == 1 and not mt.constraints(mt.heuristic(key), key)
    for other in ({**key, "T": 8}, {**key, "BI": 1, "T": 0}):
        assert mt.heuristic(mt.bucket(other))["U_GEMV"] == 0
        assert mt.constraints({**mt.heuristic(key)}, other), "GEMV must be refused off T = 1"


# ------------------------------------------------------------------------------------ indexer front
def _front_case(T, seed):
    node = _front_node()
    ops = _front_operands(node, T, 48, torch.Generator().manual_seed(seed))
    ops[-3], ops[-2] = ops[-3][:T], ops[-2][:T]
    return node, ops


def _check_front(node, ops, cfg, what):
    clone = lambda xs: [x.clone() for x in xs]  # noqa: E731
    want = Interpreter(Module("body"), {}).run(node.body, clone(ops))
    mine = clone(ops)
    q8, qs, w, keys, kscale = fr.indexer_front(mine, {**node.attrs, "batch_invariant": False}, cfg)
    assert keys is mine[6] and kscale is mine[7]
    assert_close_rel(formats.dequantize_fp8(q8, qs), formats.dequantize_fp8(want[0], want[1]), 2e-2, f"{what} q")
    assert_close_rel(qs, want[1], 1e-6, f"{what} query scales")
    assert_close_rel(w, want[2], 1e-6, f"{what} head weights")
    assert torch.equal(keys.view(torch.uint8), want[3].view(torch.uint8)), f"{what}: key pool differs"
    assert torch.equal(kscale, want[4]), f"{what}: key scales differ"
    return q8, qs


def _gemv2(split, bk, warps=4):
    return {"SPLIT": split, "GEMV": 2, "BLOCK_M": 1, "BLOCK_K": bk, "BLOCK_R": 16, "num_warps": warps, "num_stages": 1}


@pytest.mark.parametrize("T,cfg", [
    (1, None),  # the heuristic's T = 1 path: the one-token kernel (GEMV 2)
    (1, _gemv2(2, 32)),  # K = 96: three preloaded tiles, whole; parts of 16 columns
    (1, _gemv2(8, 64)),  # two tiles, the second masked; parts of 4 columns
    (3, _gemv2(4, 128)),  # one tile wider than K; three tokens, one grid row each
    (5, {"SPLIT": 2, "GEMV": 0, "BLOCK_M": 16, "BLOCK_K": 64, "BLOCK_R": 16, "num_warps": 4, "num_stages": 1}),
])
def test_indexer_front_split_path(T, cfg):
    node, ops = _front_case(T, 60 + T + (cfg or {}).get("SPLIT", 0))
    key = fr._front_bucket(fr._front_key(SimpleNamespace(operands=ops), {**node.attrs, "batch_invariant": False}))
    cfg = cfg or fr._front_heuristic(key, "cpu")
    assert cfg["SPLIT"] > 1 and not fr._front_constraints(cfg, key, "cpu")
    first = _check_front(node, ops, cfg, f"T={T} {cfg}")
    counters = fr._COUNTERS[str(ops[0].device)]
    assert int(counters.abs().sum()) == 0, "the last arriving part must reset its counter"
    again = _check_front(node, ops, cfg, "second launch")
    assert torch.equal(first[0].view(torch.uint8), again[0].view(torch.uint8)) and torch.equal(first[1], again[1])


def test_indexer_front_split_refuses_bad_configs():
    node, ops = _front_case(1, 70)
    for bad, match in ((_gemv2(3, 32), "SPLIT=3"), ({**_gemv2(2, 32), "BLOCK_M": 16}, "BLOCK_M = 1"),
                       (_gemv2(2, 16), "at most 4 weight tiles"), ({**_gemv2(2, 32), "GEMV": 1}, "GEMV=1")):
        with pytest.raises(ValueError, match=match):
            fr.indexer_front([o.clone() for o in ops], dict(node.attrs), bad)
    key = {"T": 0, "K": 64, "HI": 4, "DI": 32, "bi": 1}
    assert fr._front_heuristic(key, "h200")["SPLIT"] == 1  # batch invariance: the T-independent path
    assert fr._front_constraints(_gemv2(2, 16), {**key, "K": 96}, "cpu")  # six tiles of 16


def test_indexer_front_one_token_heuristic():
    """The rank preset's shape (K 1536, 32 heads x 128) takes the H200's measured best: the one-token kernel,
    SPLIT 8, three tiles of 512, 4 warps; a wider K cuts more parts so the preloaded weights stay within
    PRELOAD_MAX values a thread, and one too wide for even one column per part falls back to tensor-core tiles."""
    key = {"T": 1, "K": 1536, "HI": 32, "DI": 128, "bi": 0}
    cfg = fr._front_heuristic(key, "h200")
    assert cfg == _gemv2(8, 512) and not fr._front_constraints(cfg, key, "h200")
    wide = {**key, "K": 7168}
    cfg = fr._front_heuristic(wide, "h200")
    assert cfg["GEMV"] == 2 and cfg["SPLIT"] > 8 and not fr._front_constraints(cfg, wide, "h200")
    assert fr._front_constraints(_gemv2(8, 2048), wide, "h200"), "8 parts of 7168 columns must be refused"
    assert fr._front_heuristic({**key, "K": 1 << 16}, "h200")["GEMV"] == 0
    assert fr._front_heuristic({**key, "T": 2}, "h200")["GEMV"] == 0


# -------------------------------------------------------------------------------------- value gate
@pytest.mark.parametrize("T,kv,bk", [(1, 64, 64), (3, 48, 32)])
def test_value_gate_gemv_rows(T, kv, bk):
    """BLOCK_T = 1 (the T = 1 heuristic; any T runs, one grid row per token; the first weight tile loaded
    before the PDL wait, the rest in the loop), with and without the gate, kv not a multiple of BLOCK_K in the
    second case: vs the float64 formula."""
    from codegen.triton import value_gate as vg
    from ir.ref.mla import mla_value_proj

    g = torch.Generator().manual_seed(80 + T)
    H, dn, dv = 3, 16, 24
    o = torch.randn(T, H, kv, generator=g)
    kv_b = torch.randn(H * (dn + dv), kv, generator=g)
    gate = torch.randn(T, H * dv, generator=g) * 2
    cfg = vg.heuristic({"T": 1, "H": H, "KV": kv, "DV": dv, "bi": 0}, "cpu")
    assert cfg["BLOCK_T"] == 1 and cfg["BLOCK_V"] == 8 and not vg.constraints(cfg, {}, "cpu")
    cfg = {**cfg, "BLOCK_K": bk, "BLOCK_V": 16}
    want = mla_value_proj(o.double(), kv_b.double(), dn).reshape(T, H * dv)
    assert_close_rel(vg.value_gate(o, kv_b, dn, cfg), want, 1e-5, "value proj GEMV")
    assert_close_rel(vg.value_gate(o, kv_b, dn, cfg, gate=gate), want * torch.sigmoid(gate.double()), 1e-5,
                     "value gate GEMV")


_SM90_COMPILE = r'''
import os
os.environ["TRITON_INTERPRET"] = "0"
import torch
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource, compile as tc
from codegen.aot.record import Recorder
from codegen.triton import indexer_front as fr
from codegen.triton import value_gate as vg
target = GPUTarget("cuda", 90, 32)
T, K, HI, DI, bf = 1, 1536, 32, 128, torch.bfloat16
front = [torch.zeros(T, K, dtype=bf), torch.zeros(HI * DI, K, dtype=bf), torch.zeros(T, DI, dtype=bf),
         torch.zeros(DI, dtype=bf), torch.zeros(DI, dtype=bf), torch.zeros(T, HI, dtype=bf),
         torch.zeros(256, DI, dtype=torch.float8_e4m3fn), torch.zeros(256, dtype=torch.float32),
         torch.zeros(T, dtype=torch.int64), torch.zeros(T, dtype=torch.int64), torch.zeros(1, 4, dtype=torch.int32)]
attrs = dict(heads=HI, head_dim=DI, eps=1e-6, weight_scale=0.1, block_size=64)
with Recorder(target) as rec:
    fr.indexer_front(front, attrs, fr._front_heuristic({"T": 1, "K": K, "HI": HI, "DI": DI, "bi": 0}, "h200"))
    vg.value_gate(torch.zeros(T, 12, 512, dtype=bf), torch.zeros(12 * 256, 512, dtype=bf), 128,
                  vg.heuristic({"T": 1, "H": 12, "KV": 512, "DV": 128, "bi": 0}, "h200"),
                  gate=torch.zeros(T, 1536, dtype=bf))
for spec in rec.specs.values():
    fn, sig, cx, at, opts = spec.compile_args
    ptx = tc(ASTSource(fn, sig, cx, at), target=target, options=dict(vars(opts))).asm["ptx"]
    wait = ptx.index("griddepcontrol.wait")
    print(fn.__name__, ptx[:wait].count("ld.global") > 0)
'''


def test_one_token_kernels_compile_for_sm90():
    """The interpreter runs each constexpr branch on its own; the compiler types them together. The T = 1
    heuristics' indexer front and value gate, compiled to PTX for sm_90 with PDL (AOT recorder, subprocess):
    both load weights before `griddepcontrol.wait`."""
    import os
    import subprocess
    import sys
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    p = subprocess.run([sys.executable, "-c", _SM90_COMPILE], capture_output=True, text=True, timeout=300, cwd=repo,
                       env=dict(os.environ, TRITON_INTERPRET="0", PYTHONPATH=repo))
    assert p.returncode == 0, p.stderr[-3000:]
    assert sorted(p.stdout.split()) == ["True", "True", "_indexer_front_gemv_kernel", "_value_gate_kernel"], p.stdout
