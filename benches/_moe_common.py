"""Shared setup of the MoE bench (bench_moe.py) and its decode section (_moe_decode.py): the interpreter choice
on a machine without CUDA, the knobs (MOE_BENCH_*), shapes, the JSON report, timing / check / record helpers,
the expert weights (W, filled by bench_moe's make_weights section) and the fp32 reference.
"""

from __future__ import annotations

import json
import os
import sys

import torch
from _report import BenchReport, median_ms, graph_ms as graph_ms_of  # benches/_report.py (the script's folder is on sys.path)

if not torch.cuda.is_available():  # the interpreter must be chosen before triton is imported
    os.environ.setdefault("TRITON_INTERPRET", "1")
import triton  # noqa: E402,F401
import triton.language as tl  # noqa: E402,F401

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from codegen.triton import _pdl as pdl_mod  # noqa: E402,F401
from codegen.triton import moe_grouped_gemm as gg  # noqa: E402,F401
from codegen.triton import moe_router as mr  # noqa: E402
from codegen.triton import moe_tail as mt  # noqa: E402,F401
from ir.packed import PackedMXFP4  # noqa: E402

# MOE_BENCH_TINY=1: toy shapes on the CPU (interpreter) to dry-run this script's logic before the GPU call
TINY = os.environ.get("MOE_BENCH_TINY") == "1"
DEV = "cuda" if torch.cuda.is_available() else "cpu"
E, K, ELL, INTER, D, SHARED_I = (8, 2, 64, 64, 64, 128) if TINY else (112, 16, 3584, 3072, 7168, 2 * 3072)
T_DECODE, T_PREFILL = (8, 64) if TINY else (64, 8192)
ACT = torch.float32 if TINY else torch.bfloat16   # the interpreter computes bf16 wrongly (TOOLCHAIN.md)
B1, B2, EPS = 4.0, 25.0, 1e-5
# sections run in the order given (ceilings and weights always first); the layer at the token counts given
SECTIONS = os.environ.get("MOE_BENCH_SECTIONS", "router,decode,prefill,layer").split(",")
LAYER_T = [int(t) for t in os.environ.get("MOE_BENCH_LAYER_T", "").split(",") if t]
WIDE_SWEEP = os.environ.get("MOE_BENCH_SWEEP") == "wide"
COMPILE_DEADLINE, PREFILL_DEADLINE, DECODE_DEADLINE = (600, 400, 300) if WIDE_SWEEP else (260, 190, 110)
COMPILE_DEADLINE, PREFILL_DEADLINE, DECODE_DEADLINE = (
    float(os.environ.get(f"MOE_BENCH_{n}_DEADLINE", v)) for n, v in
    (("COMPILE", COMPILE_DEADLINE), ("PREFILL", PREFILL_DEADLINE), ("DECODE", DECODE_DEADLINE)))
REPORT = BenchReport("moe")
DOC, save, section = REPORT.doc, REPORT.save, REPORT.section


def ms(fn, rep=150):
    return median_ms(fn, DEV, rep)


def rel_err(a, b):
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm()).item() if torch.isfinite(a).all() else float("inf")


def record(name, t_ms, **kw):
    m = {"name": name, "median_ms": round(t_ms, 5), **kw}
    DOC["measurements"].append(m)
    print(json.dumps(m, default=str), flush=True)
    save()
    return m


def _cfg(bm, bn, bk, warps, stages, bn2=None, bk2=None, pf=0, sl=0):
    return dict(BM=bm, BN=bn, BK=bk, BN2=bn2 or bn, BK2=bk2 or bk, num_warps=warps, num_stages=stages, PF=pf, SL=sl)


def graph_ms(calls, reps=30):
    """Device time per call: one CUDA graph holding every call of `calls` (distinct routings, so the
    routed experts of a T=1 step, 35 MB, are not served from the 50 MB L2 by the previous replay),
    replayed `reps` times; the median replay over len(calls). CPU: one timed pass."""
    if DEV != "cuda":
        return median_ms(lambda: [c() for c in calls], DEV) / len(calls)
    return graph_ms_of(calls, reps)


# ----------------------------------------------------------------------------------------- data
def rand_mx(g, n, k):
    q = torch.randint(0, 256, (E, n, k // 2), generator=g, device=DEV, dtype=torch.uint8)
    s = torch.randint(119, 122, (E, n, k // 32), generator=g, device=DEV, dtype=torch.uint8)
    return PackedMXFP4(q, s)


def to_bf16(w: PackedMXFP4):
    out = torch.empty(w.shape, device=DEV, dtype=ACT)
    for e in range(0, E, 8):
        out[e:e + 8] = PackedMXFP4(w.packed[e:e + 8], w.scales[e:e + 8]).dequantize(ACT)
    return out


def mx_bytes(w: PackedMXFP4, experts: int) -> int:
    return w.nbytes // E * experts


def routing(g, T):
    logits = torch.randn(T, E, generator=g, device=DEV)
    bias = torch.randn(E, generator=g, device=DEV) * 0.1
    return mr.router(logits, bias, K, "sigmoid", True, 1.0)


def ref_experts(z, w, ids, w1, w2, w3):
    """fp32 reference of moe_experts on bf16-exact weights (the MXFP4 values are exact in bf16)."""
    from ir.ref.moe import moe_experts
    return moe_experts(z.float(), w, ids, w1, w2, w3, "situ", B1, B2)


W = {}


def situ_glu(a, u):
    return B1 * torch.tanh(a / B1) * torch.sigmoid(a) * (B2 * torch.tanh(u / B2))
