"""The grouped gate-up kernel with its packed weights read by TMA (config TMA, moe_grouped_gemm._tma_desc).

TMA needs sm_90, so the GPU code is checked by compiling it offline for sm_90 (PTX holds the bulk tensor copies and
their mbarrier waits; the decoded tile stays in registers); the kernels' logic (descriptor coordinates, scale
reads, the fold of the TMA flag into SL) runs in the Triton interpreter, whose descriptor loads read the same tiles,
in fp32 against the float64 reference and bitwise against the pointer path. The config checks keep the interpreter,
CPU targets, batch-invariant mode and SL 3 from selecting it.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch

from codegen.triton import moe_grouped_gemm as gg
from ir.formats import quantize_mxfp4
from ir.packed import PackedMXFP4
from ir.ref import moe as ref
from tests.helpers import assert_close_rel

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
E, L, I = 6, 128, 64


def _case(seed, T=12, k=3):
    g = torch.Generator().manual_seed(seed)
    w1, w3 = (torch.randn(E, I, L, generator=g) / L ** 0.5 for _ in range(2))
    w2 = torch.randn(E, L, I, generator=g) / I ** 0.5
    mx = [PackedMXFP4(*quantize_mxfp4(w)) for w in (w1, w2, w3)]
    ids = torch.argsort(torch.rand(T, E, generator=g), dim=1)[:, :k]
    ids[::4, 0] = 0                                       # expert 0 in most tokens: tiles of several rows
    ids = torch.stack([r if len(set(r.tolist())) == k else torch.randperm(E, generator=g)[:k] for r in ids])
    return torch.randn(T, L, generator=g), torch.rand(T, k, generator=g) + 0.1, ids, mx


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="compares the paths in the Triton "
                    "interpreter (fp32); on a GPU the bf16 kernels are checked by benches/bench_moe.py's t64 section")
@pytest.mark.parametrize("over", [{"SL": 1}, {"SL": 2, "BK": 32}, {"SL": 1, "SL2": 3, "BK": 128},
                                  {"SL": 2, "SL2": 0, "SPLIT": 2}])
def test_tma_path_matches_pointer_path_and_float64(over):
    """fp32 activations, the bytes16 decode: the gate-up's weights by TMA give the pointer path's result bitwise
    (same decode, same reduction order) and the float64 reference within fp32 rounding; the last expert's rows reach
    the descriptor's edge; split K reads each slice's steps."""
    z, w, ids, (w1, w2, w3) = _case(7 + len(over) + over["SL"])
    ids[-1, -1] = E - 1 if (ids[-1] != E - 1).all() else ids[-1, -1]
    cfg = {"BM": 16, "BN": 32, "BK": 64, "BN2": 32, "BK2": 32, "DEQ": "bytes16", **over}
    calls = []
    real = gg._tma_desc
    gg._tma_desc = lambda *a: calls.append(a[3:5]) or real(*a)     # noqa: E731  (the path really taken)
    try:
        y_tma = gg.moe_experts(z, w, ids, w1, w2, w3, "situ", 4.0, 25.0, {**cfg, "TMA": 1})
    finally:
        gg._tma_desc = real
    assert calls and all(c == (cfg["BN"], cfg["BK"]) for c in calls)
    y_ptr = gg.moe_experts(z, w, ids, w1, w2, w3, "situ", 4.0, 25.0, cfg)
    assert not torch.isnan(y_tma).any()
    assert torch.equal(y_tma, y_ptr)
    exp = ref.moe_experts(z.double(), w.double(), ids, *(x.dequantize(torch.float64) for x in (w1, w2, w3)),
                          "situ", 4.0, 25.0)
    assert_close_rel(y_tma, exp, 1e-5, f"TMA {over}")


def test_tma_descriptor_falls_back_to_pointers():
    """Where TMA does not apply (a byte decode, SL 3, experts not back to back), no descriptor: the pointer path."""
    q = torch.zeros(4, 64, 32, dtype=torch.int16)
    z = torch.zeros(1, 128)
    assert gg._tma_desc(q, gg.MX_ASM16I, 3, 32, 64, z) is None
    assert gg._tma_desc(q, gg.MX_BYTES16 - 3, 1, 32, 64, z) is None                      # MX_BYTES: byte pairs
    assert gg._tma_desc(q[::2], gg.MX_BYTES16, 1, 32, 64, z) is None                   # every other expert
    if os.environ.get("TRITON_INTERPRET") == "1":
        d = gg._tma_desc(q, gg.MX_BYTES16, 1, 32, 64, z)
        assert list(d.shape) == [256, 4, 8] and list(d.block_shape) == [32, 2, 8]


def test_tma_config_constraints():
    key = gg._key(64, 112, 16, 3584, 3072, True, torch.bfloat16, {})
    cfg = {**gg.heuristic(gg.bucket(key), "h200"), "TMA": 1, "SL": 1}
    assert not [m for m in gg.constraints(cfg, key, "h200") if "TMA" in m]
    assert any("TMA" in m for m in gg.constraints({**cfg, "SL": 3}, key, "h200"))         # scales a step ahead
    assert any("TMA" in m for m in gg.constraints(cfg, key, None))                         # interpreter / CPU
    assert any("TMA" in m for m in gg.constraints({**cfg, "DEQ": "asm"}, key, "h200"))     # byte decode
    assert any("TMA" in m for m in gg.constraints(cfg, {**key, "BI": 1}, "h200"))          # batch-invariant
    assert any("TMA" in m for m in gg.constraints({**cfg, "TMA": 2}, key, "h200"))
    assert not gg.heuristic(gg.bucket(key), None).get("TMA")          # never the interpreter's choice
    assert not gg.heuristic(gg.bucket({**key, "BI": 1}), "h200").get("TMA")     # nor batch-invariant mode's


def test_t64_decode_heuristic_takes_tma_gate_up():
    """H200, T=64 top-16 (issue 5's decode): the gate-up's weights by TMA with its scales read in the step, the
    down kernel's scales a step ahead (measured: _moe_configs.DECODE_T64); legal by the constraints."""
    key = gg._key(64, 112, 16, 3584, 3072, True, torch.bfloat16, {})
    cfg = gg.heuristic(gg.bucket(key), "h200")
    assert (cfg["PATH"], cfg["TMA"], cfg["SL"], cfg["SL2"], cfg["DEQ"]) == ("grouped", 1, 1, 3, "asm16i")
    assert gg.constraints(cfg, key, "h200") == []
    assert not gg.heuristic(gg.bucket(gg._key(8, 112, 2, 3584, 3072, True, torch.bfloat16, {})), "h200").get("TMA")


_AOT = textwrap.dedent("""
    import os, re, sys, json
    os.environ["TRITON_INTERPRET"] = "0"
    sys.path.insert(0, sys.argv[1])
    import triton, triton.language as tl
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from codegen.triton import moe_grouped_gemm as gg
    res = {}
    for name, fn, bn, bk, sl, stages in [("gate_up", gg._moe_gate_up_kernel, 64, 64, 1, 3),
                                         ("gate_up", gg._moe_gate_up_kernel, 64, 128, 1, 4),
                                         ("gate_up", gg._moe_gate_up_kernel, 64, 64, 2, 3)]:
        ce = dict(E_PAD=128, W_FMT=6, IEEE=False, DT=tl.bfloat16, WIDE=False, PF=0, SL=sl + 4, BM=16, BN=bn, BK=bk,
                  GROUP_M=8, SPLIT=1, KU=1, PDL=True)
        if name == "gate_up":
            ce.update(TOPK=16, ACT=0, HAS_BETA2=True)
        sig, attrs = {}, {}
        for i, a in enumerate(fn.arg_names):
            sig[a] = ("constexpr" if a in ce else f"tensordesc<i16[{bn}, {bk // 32}, 8]>" if a[0] == "w"
                      else "*i32" if a in ("pair_ptr", "counts_ptr", "offsets_ptr") or (a[0] == "s" and sl == 2
                                                                                          and a.endswith("_ptr"))
                      else "*bf16" if a in ("z_ptr", "h_ptr", "o_ptr") else "*u8" if a.endswith("_ptr")
                      else "fp32" if a.startswith("beta") else "i64" if a == "stride_we" else "i32")
            if sig[a] in ("i32", "i64") or sig[a].startswith("*"):
                if a not in ("E", "N_TILES", *gg.SCALE_NO_SPEC):
                    attrs[(i,)] = [["tt.divisibility", 16]]
        k = triton.compile(ASTSource(fn, sig, ce, attrs), target=GPUTarget("cuda", 90, 32),
                           options={"num_warps": 2, "num_stages": stages})
        ptx, ttgir = k.asm["ptx"], k.asm["ttgir"]
        res[f"{name}_{bk}_sl{sl}"] = {"bulk": ptx.count("cp.async.bulk.tensor"), "mbar_wait": ptx.count("mbarrier.try_wait"),
                               "mma": sorted(set(re.findall(r"(mma\\.sync|wgmma\\.mma_async)", ptx))),
                               "smem_operand": len(re.findall(r"local_load[^\\n]*dot_op<\\{opIdx = 0", ttgir)),
                               "imad_decode": ptx.count("%dynamic_smem_size")}
    print(json.dumps(res))
""")


def test_tma_kernels_compile_for_sm90():
    """The gate-up's TMA loads compile to bulk tensor copies (w1, w3) with mbarrier waits, the asm16i decode, and
    with SL 1 the decoded weight tile reaches the MMA from registers (no shared-memory operand), at BK 64 and 128;
    SL 2 (scale words by cp.async) compiles too (Triton 3.6 keeps its decode in registers, 3.7 does not)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    r = subprocess.run([sys.executable, "-c", _AOT, ROOT], capture_output=True, text=True, env=env, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    res = json.loads(r.stdout.strip().splitlines()[-1])
    for name in ("gate_up_64_sl1", "gate_up_128_sl1", "gate_up_64_sl2"):
        got = res[name]
        assert got["bulk"] >= 2 and got["mbar_wait"] >= 1, res
        assert got["mma"] == ["mma.sync"] and got["imad_decode"] > 0, res
    assert res["gate_up_64_sl1"]["smem_operand"] == 0 and res["gate_up_128_sl1"]["smem_operand"] == 0, res
