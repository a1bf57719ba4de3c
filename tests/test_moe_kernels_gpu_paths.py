"""GPU-only paths of the MoE expert GEMMs, checked without a GPU: the PTX E2M1 decode (DEQ asm) is
emulated instruction by instruction on every byte pair against the float64 dequantisation, and the
asm / tl.dot_scaled kernels (plus the router, combine and up-projection kernels) are compiled ahead of
time for sm_90 and sm_100 (the interpreter runs neither inline PTX nor dot_scaled). The bf16 results
of these paths at full shapes are checked on the H200 by benches/bench_moe.py.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
import torch

from codegen.triton import _moe_tiles as tiles
from codegen.triton import moe_grouped_gemm as gg
from ir.packed import PackedMXFP4
from tests.helpers import assert_close_rel
from tests.test_moe_kernels import E, I, L, _experts, _gen, _mx, _ref_experts, _routing

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _run_ptx(asm: str, operands: dict) -> dict:
    """Evaluate the straight-line PTX of an inline-asm decode on numpy uint32 arrays (the handful of
    instructions it uses), so the exact text the kernel ships is checked without a GPU."""
    import re

    import numpy as np

    regs = dict(operands)

    def val(x):
        x = x.strip()
        return np.uint32(int(x, 16) if x.startswith("0x") else int(x)) if x[0].isdigit() else regs[x]

    def bf16x2_mul(a, b):
        def halves(v):
            lo = torch.from_numpy((v & 0xFFFF).astype(np.int32).astype(np.int16)).view(torch.bfloat16).double()
            hi = torch.from_numpy((v >> 16).astype(np.int32).astype(np.int16)).view(torch.bfloat16).double()
            return lo, hi
        (al, ah), (bl, bh) = halves(np.broadcast_to(a, np.shape(a)).copy()), halves(np.broadcast_to(b, np.shape(a)).copy())
        bits = [(x * y).to(torch.bfloat16).view(torch.int16).numpy().astype(np.uint16).astype(np.uint32)
                for x, y in ((al, bl), (ah, bh))]
        return bits[0] | (bits[1] << 16)

    def prmt(a, b, sel):
        pool = [(a >> (8 * i)) & 0xFF for i in range(4)] + [(b >> (8 * i)) & 0xFF for i in range(4)]
        return sum(pool[(int(sel) >> (4 * i)) & 0x7] << np.uint32(8 * i) for i in range(4)).astype(np.uint32)

    def f16_to_f32(h):
        f = torch.from_numpy(h.astype(np.int32).astype(np.int16)).view(torch.float16).float()
        return f.view(torch.int32).numpy().astype(np.uint32)

    def mul_lo(a, b):
        return ((np.asarray(a, dtype=np.uint64) * np.asarray(b, dtype=np.uint64)) & 0xFFFFFFFF).astype(np.uint32)

    ops = {"mov.b32": lambda a: a, "mov.u32": lambda a: a, "cvt.f32.f16": f16_to_f32,
           "shl.b32": lambda a, n: (a << n).astype(np.uint32), "shr.b32": lambda a, n: a >> n,
           "shr.u32": lambda a, n: a >> n, "add.u32": lambda a, b: (np.asarray(a, dtype=np.uint64) + b).astype(np.uint32),
           "mul.lo.u32": mul_lo, "or.b32": lambda a, b: a | b, "and.b32": lambda a, b: a & b, "prmt.b32": prmt,
           "mul.rn.bf16x2": bf16x2_mul}
    for line in asm.splitlines():
        line = line.strip().rstrip(";")
        if not line or line in "{}" or line.startswith(".reg"):
            continue
        op, args = line.split(None, 1)
        if op == "mov.b32" and args.startswith("{"):        # unpack a register into its 16-bit halves
            halves, src_reg = args[1:].split("}")
            lo, hi = (h.strip() for h in halves.split(","))
            v = val(src_reg.strip(" ,"))
            regs[lo], regs[hi] = v & np.uint32(0xFFFF), v >> np.uint32(16)
            continue
        dst, *src = [a.strip() for a in args.split(",")]
        if op not in ops:
            raise AssertionError(f"PTX emulator: unexpected instruction {op!r}")
        regs[dst] = np.asarray(ops[op](*(val(x) for x in src)), dtype=np.uint32)
    return {k: v for k, v in regs.items() if re.fullmatch(r"\$\d+", k)}


@pytest.mark.parametrize("wide", [False, True])
def test_e2m1_ptx_decode_is_exact_for_every_byte_pair(wide):
    """The PTX decode (DEQ asm, bf16, GPU only) emulated instruction by instruction on all 65536 byte
    pairs under E8M0 scales 2^-127 .. 2^127 equals the float64 dequantisation (WIDE: scale bytes 1..254)."""
    import numpy as np

    pairs = np.arange(1 << 16, dtype=np.uint32)
    pool = [1, 60, 120, 128] + ([129, 254] if wide else [0])
    for s in pool:
        f = s << 7 if wide else (s + 126) << 7                      # _scale_factor's bf16 bits
        out = _run_ptx((tiles.E2M1_ASM_WIDE if wide else tiles.E2M1_ASM).value,
                       {"$2": pairs, "$3": np.uint32(f | (f << 16))})
        got = []
        for reg in ("$0", "$1"):
            for half in (out[reg] & 0xFFFF, out[reg] >> 16):      # element j, then j+1
                got.append(torch.from_numpy(half.astype(np.int32).astype(np.int16)).view(torch.bfloat16).double())
        lo0, lo1, hi0, hi1 = got
        packed = torch.from_numpy(pairs.astype(np.int64)).view(-1, 1)
        packed = torch.cat([packed & 0xFF, packed >> 8], 1).to(torch.uint8).view(1 << 12, 32)   # 16 pairs a row
        ref = PackedMXFP4(packed, torch.full((1 << 12, 2), s, dtype=torch.uint8)).dequantize(torch.float64)
        got = torch.stack([lo0, hi0, lo1, hi1], 1).view(1 << 12, 64)
        assert torch.equal(got, ref), f"scale byte {s}"


@pytest.mark.parametrize("wide", [False, True])
@pytest.mark.parametrize("deq", ["asm16", "asm16i"])
def test_e2m1_ptx_16bit_word_decode_is_exact(wide, deq):
    """The 16-bit-word PTX decode (DEQ asm16: E2M1_ASM16[c] gives code c of two int16 elements; asm16i: its
    left shifts as multiplies by 2^n + (%dynamic_smem_size >> 24)), emulated on every 16-bit value in each half
    of the register under E8M0 scales 2^-127 .. 2^127 (code 1, the value 0.5, a bf16 subnormal before the
    scale), equals the float64 dequantisation of those bytes."""
    import numpy as np

    table = {("asm16", False): tiles.E2M1_ASM16, ("asm16", True): tiles.E2M1_ASM16_WIDE,
             ("asm16i", False): tiles.E2M1_ASM16I, ("asm16i", True): tiles.E2M1_ASM16I_WIDE}[deq, wide]

    words = np.arange(1 << 16, dtype=np.uint32)
    other = np.random.default_rng(7).permutation(words).astype(np.uint32)
    x = words | (other << 16)                                     # element j: words, element j+1: other
    for s in [1, 60, 120, 128] + ([129, 254] if wide else [0]):
        f = s << 7 if wide else (s + 126) << 7
        got = {}
        for c in range(4):
            out = _run_ptx(table[c].value, {"$1": x, "$2": np.uint32(f | (f << 16)),
                                            "%dynamic_smem_size": np.uint32(12544)})["$0"]
            for half, name in ((out & 0xFFFF, "j"), (out >> 16, "j1")):
                got[name, c] = torch.from_numpy(half.astype(np.int32).astype(np.int16)).view(torch.bfloat16).double()
        for name, vals in (("j", words), ("j1", other)):
            packed = torch.from_numpy(vals.astype(np.int64)).view(-1, 1)
            packed = torch.cat([packed & 0xFF, packed >> 8], 1).to(torch.uint8).view(1 << 12, 32)
            ref = PackedMXFP4(packed, torch.full((1 << 12, 2), s, dtype=torch.uint8)).dequantize(torch.float64)
            mine = torch.stack([got[name, c] for c in range(4)], 1).view(1 << 12, 64)   # columns 4j + c
            assert torch.equal(mine, ref), f"scale byte {s}, element {name}"


def test_gemv_code_pair_ptx_is_exact_for_every_half_word():
    """_moe_gemv.CODE_PAIR_PTX[c]: codes c and c+4 of a word as fp32 E2M1 · 2^-14, every 16-bit pattern in
    both halves, emulated instruction by instruction against the float64 dequantisation."""
    import numpy as np

    from codegen.triton import _moe_gemv as gv
    lo = np.arange(1 << 16, dtype=np.uint32)
    words = lo | (lo[::-1] << np.uint32(16))
    got = {}
    for c in range(4):
        out = _run_ptx(gv.CODE_PAIR_PTX[c].value, {"$2": words})
        for j, reg in ((c, "$0"), (c + 4, "$1")):
            got[j] = torch.from_numpy(out[reg].astype(np.uint32).view(np.int32)).view(torch.float32).double()
    packed = torch.from_numpy(words.view(np.uint8).copy()).view(-1, 32)      # 8 words: a row of two blocks
    ref = PackedMXFP4(packed, torch.full((packed.shape[0], 2), 127, dtype=torch.uint8)).dequantize(torch.float64)
    mine = torch.stack([got[j] for j in range(8)], 1).reshape(-1, 64) * 2.0 ** 14    # columns 8q + j
    assert torch.equal(mine, ref)


_AOT = textwrap.dedent("""
    import os, re, sys, json
    os.environ["TRITON_INTERPRET"] = "0"
    sys.path.insert(0, sys.argv[1])
    import triton, triton.language as tl
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from codegen.triton import moe_grouped_gemm as gg
    res = {}
    for name, fn, cc, wf, cfg in [("gate_up", gg._moe_gate_up_kernel, 100, 2, (128, 128, 128)),
                                  ("down", gg._moe_down_kernel, 100, 2, (128, 128, 128)),
                                  ("gate_up", gg._moe_gate_up_kernel, 90, 2, (16, 128, 128)),
                                  ("gate_up", gg._moe_gate_up_kernel, 90, 3, (16, 128, 128)),
                                  ("down", gg._moe_down_kernel, 90, 3, (16, 128, 128)),
                                  ("gate_up", gg._moe_gate_up_kernel, 90, 5, (16, 128, 64)),
                                  ("down", gg._moe_down_kernel, 90, 5, (16, 128, 64)),
                                  ("down", gg._moe_down_kernel, 90, 1, (128, 128, 64)),
                                  ("gate_up", gg._moe_gate_up_kernel, 90, 5, (16, 64, 128, 4)),
                                  ("down", gg._moe_down_kernel, 90, 5, (16, 64, 128, 4)),
                                  ("gate_up", gg._moe_gate_up_kernel, 90, 5, (16, 64, 128, 1, 3)),   # SL=3, 2
                                  ("down", gg._moe_down_kernel, 90, 5, (16, 64, 128, 1, 3)),
                                  ("gate_up", gg._moe_gate_up_kernel, 90, 5, (16, 64, 128, 1, 2)),
                                  ("gate_up", gg._moe_gate_up_kernel, 90, 5, (16, 64, 64, 1, 3, 4)),  # KU=4
                                  ("down", gg._moe_down_kernel, 90, 5, (16, 64, 64, 1, 3, 4)),
                                  ("gate_up", gg._moe_gate_up_kernel, 90, 6, (16, 64, 64, 1, 3))]:   # asm16i
        split = cfg[3] if len(cfg) > 3 else 1
        sl = cfg[4] if len(cfg) > 4 else int(wf == 5)
        ku = cfg[5] if len(cfg) > 5 else 1
        ce = dict(E_PAD=128, W_FMT=wf, IEEE=False, DT=tl.bfloat16, WIDE=False, PF=cc == 90 and len(cfg) < 5, SL=sl, BM=cfg[0], BN=cfg[1],
                  BK=cfg[2], GROUP_M=8, SPLIT=split, KU=ku)
        if name == "gate_up":
            ce.update(TOPK=16, ACT=0, HAS_BETA2=True)
        if split > 1:
            name += f"_split{split}"
        if len(cfg) > 4:
            name += f"_sl{sl}"
        if ku > 1:
            name += f"_ku{ku}"
        ce["PDL"] = True
        sig, attrs = {}, {}
        for i, a in enumerate(fn.arg_names):
            sig[a] = ("constexpr" if a in ce else "*i32" if a in ("pair_ptr", "counts_ptr", "offsets_ptr")
                      else "*fp32" if split > 1 and (a, name) in (("h_ptr", "gate_up"), ("o_ptr", "down"))
                      else "*bf16" if a in ("z_ptr", "h_ptr", "o_ptr") or (a[0] in "ws" and not wf)
                      else "*i16" if a[0] == "w" and wf in (5, 6) else "*i32" if a[0] == "s" and a.endswith("_ptr") and sl == 2
                      else "*u8" if a.endswith("_ptr")
                      else "fp32" if a.startswith("beta") else "i64" if a == "stride_we" else "i32")
            # the SL entries: as the T=64 launches specialise (scale strides divisible by 16)
            plain = ("E", "N_TILES", *gg.SCALE_NO_SPEC) if len(cfg) > 4 else ("E", "stride_se", "stride_sn", "N_TILES")
            if sig[a] != "constexpr" and not sig[a].startswith("fp") and a not in plain:
                attrs[(i,)] = [["tt.divisibility", 16]]
        k = triton.compile(ASTSource(fn, sig, ce, attrs), target=GPUTarget("cuda", cc, 32),
                           options={"num_warps": 2 if len(cfg) > 4 else 8, "num_stages": 3})   # SL: the decode tiles
        ptx = k.asm["ptx"]
        res[f"{name}_sm{cc}_w{wf}_pdl"] = ptx.count("griddepcontrol.wait")
        res[f"{name}_sm{cc}_w{wf}_imad_decode"] = ptx.count("%dynamic_smem_size")  # asm16i's unfoldable zero
        res[f"{name}_sm{cc}_w{wf}"] = sorted(set(re.findall(r"(tcgen05\\.mma[.\\w:]*|wgmma\\.mma_async|mma\\.sync)", ptx)))
        # the decoded weight tile goes to wgmma from registers, never through shared memory
        res[f"{name}_sm{cc}_w{wf}_smem_operand"] = len(re.findall(r"local_load[^\\n]*dot_op<\\{opIdx = 0", k.asm["ttgir"]))
    from codegen.triton import moe_router as mr, moe_tail as mt
    for fn, ptrs, ce in [
            (mr._moe_router_kernel, {"logits_ptr": "*fp32", "bias_ptr": "*fp32", "w_ptr": "*fp32", "ids_ptr": "*i64"},
             dict(PER=32, N_GROUP=4, TOPK_GROUP=2, G_PAD=4, P_PAD=32, TOPK=6, K_PAD=8, BLOCK_T=16, SOFTMAX=True,
                  HAS_BIAS=True, RENORM=True)),
            (mr._scatter_pairs_kernel, {"ids_ptr": "*i64", "chunk_base_ptr": "*i32", "counts_ptr": "*i32",
                                        "offsets_ptr": "*i32", "pair_ids_ptr": "*i32"}, dict(E_PAD=128, CHUNK=128)),
            (mr._permute_one_program_kernel, {"ids_ptr": "*i64", "counts_ptr": "*i32", "offsets_ptr": "*i32",
                                              "pair_ids_ptr": "*i32"}, dict(E_PAD=128, CHUNK=128)),
            (gg._glu_splits_kernel, {"part_ptr": "*fp32", "h_ptr": "*bf16"},
             dict(SPLIT=4, ACT=0, HAS_BETA2=True, BR=2, BI=1024)),
            (gg._combine_splits_kernel, {"o_ptr": "*fp32", "w_ptr": "*fp32", "ids_ptr": "*i64", "y_ptr": "*fp32"},
             dict(TOPK=2, SPLIT=4, BT=1, BL=1024)),
            (gg._combine_splits_kernel, {"o_ptr": "*bf16", "w_ptr": "*fp32", "ids_ptr": "*i64", "y_ptr": "*fp32"},
             dict(TOPK=16, SPLIT=1, BT=4, BL=1024)),   # moe_tail.combine: bf16 per-pair rows, one "split"
            (mt._latent_norm_kernel, {"y_ptr": "*fp32", "g_ptr": "*bf16", "out_ptr": "*bf16"}, dict(BT=1, BL=4096)),
            (mt._up_proj_add_kernel, {"y_ptr": "*bf16", "w_ptr": "*bf16", "sh_ptr": "*bf16", "out_ptr": "*bf16"},
             dict(IEEE=False, DT=tl.bfloat16, BM=64, BN=32, BK=128, GROUP_M=8))]:
        ce = {**ce, "PDL": True} if "PDL" in fn.arg_names else ce
        sig = {a: "constexpr" if a in ce else ptrs.get(a, "fp32" if a in ("scaling", "eps", "beta1", "beta2") else "i32")
               for a in fn.arg_names}
        k = triton.compile(ASTSource(fn, sig, ce), target=GPUTarget("cuda", 90, 32), options={"num_warps": 4})
        res[fn.__name__ + "_sm90"] = ["ok"]
        res[fn.__name__ + "_sm90_pdl"] = k.asm["ptx"].count("griddepcontrol.wait")
    from codegen.triton import _moe_gemv as gv, _moe_gemv_words as gvw
    for mma, stages in ((0, 1), (1, 3)):       # the FFMA path with its PTX decode; the MMA step (asm16)
        wt = "*i16" if mma else "*i32"
        com = dict(TOPK=2, MX=True, GN=16, BQ=64, STEP=512 if not mma else 256, ASM=not mma, MMA=bool(mma),
                   W_FMT=5 if mma else 0, DT=tl.bfloat16, IEEE=False, WIDE=False, PDL=True)
        for fn, ptrs, ce in [
                (gv._gemv_gate_up_kernel, {"z_ptr": "*bf16", "ids_ptr": "*i64", "w1_ptr": wt, "w3_ptr": wt,
                                           "s1_ptr": "*u8", "s3_ptr": "*u8", "h_ptr": "*bf16"},
                 dict(ACT=0, HAS_BETA2=True, **com)),
                (gv._gemv_down_combine_kernel, {"h_ptr": "*bf16", "wt_ptr": "*fp32", "ids_ptr": "*i64", "w2_ptr": wt,
                                                "s2_ptr": "*u8", "y_ptr": "*fp32"}, com)]:
            sig = {a: "constexpr" if a in ce else ptrs.get(a, "fp32" if a.startswith("beta") else "i32")
                   for a in fn.arg_names}
            div = {(i,): [["tt.divisibility", 16]] for i, a in enumerate(fn.arg_names)   # as the launcher specialises
                   if sig[a] != "constexpr" and not sig[a].startswith("fp") and a not in ("E", "NP", "NT")}
            k = triton.compile(ASTSource(fn, sig, ce, div), target=GPUTarget("cuda", 90, 32),
                               options={"num_warps": 1 if mma else 4, "num_stages": stages})
            key = f"{fn.__name__}_mma{mma}_sm90"
            res[key] = sorted(set(re.findall(r"(mma\\.sync[.\\w]*|wgmma\\.mma_async|cvt\\.f32\\.f16|cp\\.async)",
                                             k.asm["ptx"])))
            res[key + "_smem_operand"] = len(re.findall(r"local_load[^\\n]*dot_op<\\{opIdx = 0", k.asm["ttgir"]))
            res[key + "_pdl"] = k.asm["ptx"].count("griddepcontrol.wait")
    # GV=2: the heuristic's T=1 tiles (gate-up 8 x 1024, 16-byte activation loads; down 8 x 512, h as fp32 words)
    v2 = dict(ASM=True, PREF=1, EVEN=False, PDL=True, DT=tl.bfloat16, TOPK=2)
    for fn, ptrs, ce in [
            (gvw._gate_up_v2_kernel, {"z_ptr": "*bf16", "ids_ptr": "*i64", "w1_ptr": "*i32", "w3_ptr": "*i32",
                                      "s1_ptr": "*u8", "s3_ptr": "*u8", "h_ptr": "*fp32"},
             dict(ACT=0, HAS_BETA2=True, GN=8, BQ4=32, XV=1, HX=True, **v2)),
            (gvw._down_v2_kernel, {"h_ptr": "*fp32", "wt_ptr": "*fp32", "ids_ptr": "*i64", "w2_ptr": "*i32",
                                   "s2_ptr": "*u8", "o_ptr": "*fp32", "cnt_ptr": "*i32", "y_ptr": "*fp32"},
             dict(GN=8, BQ4=16, XV=2, **{**v2, "EVEN": True}))]:
        sig = {a: "constexpr" if a in ce else ptrs.get(a, "fp32" if a.startswith("beta") else "i32") for a in fn.arg_names}
        div = {(i,): [["tt.divisibility", 16]] for i, a in enumerate(fn.arg_names)
               if sig[a] != "constexpr" and not sig[a].startswith("fp") and a not in ("E", "NP")}
        k = triton.compile(ASTSource(fn, sig, ce, div), target=GPUTarget("cuda", 90, 32),
                           options={"num_warps": 4, "num_stages": 1})
        ptx = k.asm["ptx"]
        res[fn.__name__ + "_sm90"] = sorted(set(re.findall(r"(ld\\.global(?:\\.\\w+)*\\.v4\\.b32|cvt\\.f32\\.f16|atom\\.\\w+)", ptx)))
        res[fn.__name__ + "_sm90_pdl"] = ptx.count("griddepcontrol.wait")
    print(json.dumps(res))
""")


def test_gpu_paths_compile_for_sm100_and_sm90():
    """tl.dot_scaled and the PTX decode cannot run in the interpreter (Triton 3.7's has no dot_scaled;
    inline PTX needs a GPU), so those MXFP4 kernels are compiled ahead of time instead; so are the
    byte path and the router, combine and up-projection kernels for sm_90, which the interpreter
    runs but does not lower (it let a non-constexpr global through that the compiler rejects)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    r = subprocess.run([sys.executable, "-c", _AOT, ROOT], capture_output=True, text=True, env=env, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    import json
    res = json.loads(r.stdout.strip().splitlines()[-1])
    assert any(s.startswith("tcgen05.mma") for s in res["gate_up_sm100_w2"]), res
    assert any(s.startswith("tcgen05.mma") for s in res["down_sm100_w2"]), res
    assert res["gate_up_sm90_w2"] and res["down_sm90_w1"], res
    # decode tiles (16 tokens) still reach wgmma on sm_90: the weights are the MMA's M side, decoded in registers
    assert res["gate_up_sm90_w3"] == ["wgmma.mma_async"] and res["down_sm90_w3"] == ["wgmma.mma_async"], res
    assert res["gate_up_sm90_w5"] == ["wgmma.mma_async"] and res["down_sm90_w5"] == ["wgmma.mma_async"], res
    # split-K: the same MMA path and register-resident decode; the partials are reduced in their own pass
    assert res["gate_up_split4_sm90_w5"] and res["down_split4_sm90_w5"], res
    for k in ("gate_up_sm90_w3", "down_sm90_w3", "gate_up_sm90_w5", "down_sm90_w5", "gate_up_split4_sm90_w5",
              "down_split4_sm90_w5"):
        assert res[k + "_smem_operand"] == 0, (k, res)
    assert res["_moe_router_kernel_sm90"] and res["_up_proj_add_kernel_sm90"], res
    assert res["_permute_one_program_kernel_sm90"] and res["_glu_splits_kernel_sm90"], res
    # the per-pair path: FFMA with the PTX decode (no MMA); the MMA variant reaches mma.sync, its packed
    # tiles through cp.async stages, the decoded weights straight from registers
    for kern in ("_gemv_gate_up_kernel", "_gemv_down_combine_kernel"):
        assert res[kern + "_mma0_sm90"] == ["cvt.f32.f16"], res
        assert {"mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32", "cp.async"} <= set(res[kern + "_mma1_sm90"]), res
        assert res[kern + "_mma1_sm90_smem_operand"] == 0, res
        assert res[kern + "_mma0_sm90_pdl"] == 1 and res[kern + "_mma1_sm90_pdl"] == 1, res
    # GV=2: the PTX decode, 16-byte weight loads, the slot combine's counter atomics; every kernel of the decode
    # path waits for its predecessor exactly once in its code (PDL)
    assert {"cvt.f32.f16", "ld.global.v4.b32"} <= set(res["_gate_up_v2_kernel_sm90"]), res
    assert "cvt.f32.f16" in res["_down_v2_kernel_sm90"] and any(a.startswith("atom.") for a in res["_down_v2_kernel_sm90"]), res
    for kern in ("_gate_up_v2_kernel", "_down_v2_kernel", "_moe_router_kernel", "_scatter_pairs_kernel",
                 "_permute_one_program_kernel", "_glu_splits_kernel", "_combine_splits_kernel"):
        assert res[kern + "_sm90_pdl"] == 1, (kern, res)
    for k in ("gate_up_sm90_w3", "down_sm90_w3", "gate_up_split4_sm90_w5", "gate_up_sl3_sm90_w5", "down_sl3_sm90_w5",
              "gate_up_sl2_sm90_w5"):
        assert res[k + "_pdl"] == 1, (k, res)
    # the T=64 decode tiles (64 x 16 on 2 warps): scale bytes a K step ahead (SL=3) keep the decode on the packed
    # tile; int32 scale words (SL=2) compile
    assert res["gate_up_sl3_sm90_w5_smem_operand"] == 0 and res["down_sl3_sm90_w5_smem_operand"] == 0, res
    assert res["gate_up_sl2_sm90_w5"], res
    # KU=4 (four K steps an iteration, their weight rows' pieces requested together) and asm16i (the decode's left
    # shifts as multiplies): the same register decode
    for k in ("gate_up_sl3_ku4_sm90_w5", "down_sl3_ku4_sm90_w5", "gate_up_sl3_sm90_w6"):
        assert res[k] == ["mma.sync"] and res[k + "_smem_operand"] == 0 and res[k + "_pdl"] == 1, (k, res)
    assert res["gate_up_sl3_sm90_w6_imad_decode"] > 0 and res["gate_up_sl3_sm90_w5_imad_decode"] == 0, res


# ---- host side of the grouped kernels' GPU-motivated options, run in the interpreter (fp32, tiny shapes)


def test_scale_words_need_four_byte_groups():
    """SL=2 views the E8M0 bytes as int32 words: K/32 = 2 bytes a row cannot be (falls back to SL=1, same
    result); K/32 = 4 can, and the words hold the bytes little-endian (byte c = scale group 4w + c)."""
    g = _gen(403)
    T, k = 7, 2
    z = torch.randn(T, L, generator=g)
    w, ids = _routing(g, T, k, "random")
    w1, w2, w3 = (_mx(x) for x in _experts(g))
    assert gg.scale_words(2, tiles.MX_BYTES, w1.scales, (0, 0, 2, 2))[0] == 1          # L = 64: 2 bytes a row
    wide = _mx(torch.randn(3, 5, 128, generator=g))
    sl, words, st = gg.scale_words(2, tiles.MX_BYTES, wide.scales, (0, 0, 20, 4))
    assert sl == 2 and st[2:] == (5, 1) and words.dtype == torch.int32
    assert int(words[1, 2, 0]) & 0xFF == int(wide.scales[1, 2, 0]) and (int(words[1, 2, 0]) >> 24) & 0xFF == int(
        wide.scales[1, 2, 3])
    cfg = {"BM": 16, "BN": 64, "BK": 64, "BN2": 64, "BK2": 64, "DEQ": "bytes", "SL": 2}
    y = gg.moe_experts(z, w, ids, w1, w2, w3, "silu", None, None, cfg)
    assert_close_rel(y, _ref_experts(z, w, ids, w1, w2, w3, "silu", None, None), 1e-5, "SL=2 fallback")


def test_expert_pair_outputs_launches_apart():
    """kernels=: the gate-up or the down launch alone (bench_moe.py times them apart; the other launch gets
    an empty grid) runs and returns o's shape; the default runs both and matches the reference."""
    g = _gen(404)
    T, k = 6, 2
    z = torch.randn(T, L, generator=g)
    w, ids = _routing(g, T, k, "random")
    w1, w2, w3 = (_mx(x) for x in _experts(g))
    cfg = {"BM": 16, "BN": 64, "BK": 64, "BN2": 64, "BK2": 64, "DEQ": "bytes"}
    o, seg = gg.expert_pair_outputs(z, ids, w1, w2, w3, "silu", None, None, cfg)
    for kernels in (("gate_up",), ("down",), ()):
        part, _ = gg.expert_pair_outputs(z, ids, w1, w2, w3, "silu", None, None, cfg, seg, kernels=kernels)
        assert part.shape == o.shape
    y = gg.combine_pairs(o, w, ids, E)
    assert_close_rel(y, _ref_experts(z, w, ids, w1, w2, w3, "silu", None, None), 1e-5, "both launches")


@pytest.mark.parametrize("ku,ku2,deq", [(1, 1, "bytes16"), (4, 2, "bytes"), (2, 1, "bytes16")])
def test_grouped_down_kernel_own_launch_options(ku, ku2, deq):
    """The down kernel's own warps / stages / register cap (num_warps2, num_stages2, MAXNREG2; T=64's heuristic sets
    them apart from the gate-up's) give the same result; so do K steps unrolled KU / KU2 to an iteration (the
    steps past K masked: l = I = 64 with BK 32 x KU 4 covers 128 columns); a cap outside 32..255 is rejected,
    and an unrolled K with split-K."""
    g = _gen(601)
    T, k = 6, 3
    z = torch.randn(T, L, generator=g)
    w, ids = _routing(g, T, k, "skewed")
    w1, w2, w3 = (_mx(x) for x in _experts(g))
    bk = 32 if deq == "bytes" else 64
    cfg = {"BM": 16, "BN": 32, "BK": bk, "BN2": 32, "BK2": bk, "DEQ": deq, "SL": 3, "num_warps": 2,
           "num_stages": 2, "num_warps2": 1, "num_stages2": 3, "MAXNREG": 128, "MAXNREG2": 96, "KU": ku, "KU2": ku2}
    y = gg.moe_experts(z, w, ids, w1, w2, w3, "situ", 4.0, 25.0, cfg)
    assert_close_rel(y, _ref_experts(z, w, ids, w1, w2, w3, "situ", 4.0, 25.0), 1e-5, f"launch options {cfg}")
    if ku > 1:
        with pytest.raises(ValueError, match="unsplit K"):
            gg.moe_experts(z, w, ids, w1, w2, w3, "situ", 4.0, 25.0, {**cfg, "SPLIT": 2})
    key = {"T": T, "E": E, "K": k, "L": L, "I": I, "MX": 1, "BF16": 0, "BI": 0}
    full = {**gg.heuristic(gg.bucket(key), None), **cfg}
    assert gg.constraints(full, key, None) == []
    assert any("MAXNREG2=300" in c for c in gg.constraints({**full, "MAXNREG2": 300}, key, None))
