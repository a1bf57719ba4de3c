"""Where the T=64 Gluon MoE kernels' time goes (issue 5's open goal): the gate-up (`_moe_grouped_gluon`, its GGU loop:
GLUON_T64) and the down kernel (`_moe_down_gluon`) rebuilt with parts taken out (`_ablate.py`: edits applied to the
modules' source at run time), each kernel timed alone under graph replay as bench_moe's t64 section times its kernels
(`_moe_t64._parts`: distinct routings, the heuristic's config). Bits of ABL:
    1 the activation columns (z / h) of a step from a two-step window: always L1-resident, the same instructions
    2 no activation loads in the loop (the first steps' columns reused)
    4 the weight words and scale bytes of a step from a two-step window (the program's first two steps: L1 /
      L2-resident, the same loads and decode): no weight stream from HBM
    8 no decode: the words and scale factors moved into the A registers as they are (a mov per register, the loads
      kept live) instead of `_a_mul`'s masks, multiplies and bf16 scaling
The results are wrong under any bit but 0: only the times mean anything. Run by the t64 section:

    cd benches && MOE_BENCH_SECTIONS=t64 MOE_BENCH_T64_ABLATE=1 MOE_BENCH_T64_PROBES=0 PYTHONPATH=..:. \
        python3 bench_moe.py
MOE_BENCH_T64_ABLATE_BITS (default 0,1,2,4,8,6,12,14,5), _ROUNDS (2) and _CFG (config overrides) choose the runs.
"""

from __future__ import annotations

import json
import os

from _ablate import AblatedLaunch, ablated_module, guard
from _moe_common import DOC, record

from codegen.triton import _moe_down_gluon as gd_gluon, _moe_grouped_gluon as gg_gluon

RAW = 'RAW_ASM = gl.constexpr("mov.b32 $0, $4;\\nmov.b32 $1, $4;\\nmov.b32 $2, $12;\\nmov.b32 $3, $12;")\n'


def _columns(var: str, step: str, base: str, stride: str, indent: int) -> str:
    """The load of `var` (step `step`'s columns) under bits 2 (none) and 1 (a two-step window)."""
    pad = " " * indent
    return (f"{pad}if ABL & 2:\n{pad}    {var} = xa\n"
            f"{pad}elif ABL & 1:\n{pad}    {var} = gl.load(xr + (({step}) % 2) * {stride})\n"
            f"{pad}else:\n{pad}    {var} = gl.load(xr + {base} * {stride})")


_GU_W = ["                w1a, w3a, s1a, s3a = _w_step(w1r, w3r, s1r, s3r, gl.where(st + 2 < STEPS, st + 2, "
         "st + 2 - STEPS), NWT)",
         "                w1b, w3b, s1b, s3b = _w_step(w1r, w3r, s1r, s3r, gl.where(st + 3 < STEPS, st + 3, "
         "st + 3 - STEPS), NWT)"]
_GU_STEP = """    b = _z_operand(x, ZL, DB, NWT, BN)
    if DEC == 1:
        return (mma_v2(_a_mul(w1, s1, A4, DA, M, NWT, WIDE), b, acc1),
                mma_v2(_a_mul(w3, s3, A4, DA, M, NWT, WIDE), b, acc3))"""
GATE_UP_EDITS = {
    "_a_mul RAW parameter": ("NWT: gl.constexpr, WIDE: gl.constexpr):\n    \"\"\"`_moe_gemv_gluon._a_operand`",
                             "NWT: gl.constexpr, WIDE: gl.constexpr,\n          RAW: gl.constexpr = 0):\n"
                             "    \"\"\"`_moe_gemv_gluon._a_operand`"),
    "_a_mul RAW asm (8)": ("v = gl.inline_asm_elementwise(WORD_MUL_ASM_WIDE if WIDE else WORD_MUL_ASM,",
                           "v = gl.inline_asm_elementwise(RAW_ASM if RAW else WORD_MUL_ASM_WIDE if WIDE else "
                           "WORD_MUL_ASM,"),
    "RAW_ASM": ("\n\ndef layouts(", "\n\n" + RAW + "\n\ndef layouts("),
    "_gu_step ABL": ("DB: gl.constexpr):\n    \"\"\"GGU: one K step", "DB: gl.constexpr, ABL: gl.constexpr = 0):\n"
                     "    \"\"\"GGU: one K step"),
    "_gu_step decode": (_GU_STEP, _GU_STEP.replace("NWT, WIDE)", "NWT, WIDE, ABL & 8)")),
    "kernel ABL": ("ZL: gl.constexpr = None, DONE: gl.constexpr = 0):",
                   "ZL: gl.constexpr = None, DONE: gl.constexpr = 0, ABL: gl.constexpr = 0):"),
    "step a": ("_gu_step(acc1, acc3, w1a, w3a, s1a, s3a, xa, DEC, WIDE, M, NWT, BN, A4, ZL, DA, DB)",
               "_gu_step(acc1, acc3, w1a, w3a, s1a, s3a, xa, DEC, WIDE, M, NWT, BN, A4, ZL, DA, DB, ABL)"),
    "step b": ("_gu_step(acc1, acc3, w1b, w3b, s1b, s3b, xb, DEC, WIDE, M, NWT, BN, A4, ZL, DA, DB)",
               "_gu_step(acc1, acc3, w1b, w3b, s1b, s3b, xb, DEC, WIDE, M, NWT, BN, A4, ZL, DA, DB, ABL)"),
    "z b (1, 2)": ("                xb = gl.load(xr + (st + 1) * 16 * NWT)",
                   _columns("xb", "st + 1", "(st + 1)", "16 * NWT", 16)),
    "z a (1, 2)": ("                xa = gl.load(xr + gl.where(st + 2 < STEPS, st + 2, 0) * 16 * NWT)",
                   _columns("xa", "st + 2", "gl.where(st + 2 < STEPS, st + 2, 0)", "16 * NWT", 16)),
    "words a (4)": (_GU_W[0], guard(_GU_W[0], 4, "w1a, w3a, s1a, s3a = _w_step(w1r, w3r, s1r, s3r, st % 2, NWT)",
                                    indent=16)),
    "words b (4)": (_GU_W[1], guard(_GU_W[1], 4, "w1b, w3b, s1b, s3b = _w_step(w1r, w3r, s1r, s3r, (st + 1) % 2, "
                                    "NWT)", indent=16)),
}
_DN_W = ["            wa, sa = _w_at(wr, sr, st + 2, STEPS, NWT)",
         "            wb, sb = _w_at(wr, sr, st + 3, STEPS, NWT)"]
DOWN_EDITS = {
    "the ablated A side": ("from codegen.triton._moe_grouped_gluon import _a_mul,", "from _moe_grouped_gluon_ablated "
                           "import _a_mul,"),
    "_step ABL": ("DB: gl.constexpr):\n    \"\"\"acc += (a K step's", "DB: gl.constexpr, ABL: gl.constexpr = 0):\n"
                  "    \"\"\"acc += (a K step's"),
    "_step decode (8)": ("_a_mul(w, s, A4, DA, M, NWT, WIDE)", "_a_mul(w, s, A4, DA, M, NWT, WIDE, ABL & 8)"),
    "kernel ABL": ("HL: gl.constexpr):\n    \"\"\"o[pair_ids[pos], rows]", "HL: gl.constexpr, ABL: gl.constexpr = 0):\n"
                   "    \"\"\"o[pair_ids[pos], rows]"),
    "step a": ("acc = _step(acc, wa, sa, xa, WIDE, M, NWT, BN, A4, HL, DA, DB)",
               "acc = _step(acc, wa, sa, xa, WIDE, M, NWT, BN, A4, HL, DA, DB, ABL)"),
    "step b": ("acc = _step(acc, wb, sb, xb, WIDE, M, NWT, BN, A4, HL, DA, DB)",
               "acc = _step(acc, wb, sb, xb, WIDE, M, NWT, BN, A4, HL, DA, DB, ABL)"),
    "h b (1, 2)": ("            xb = gl.load(xr + (st + 1) * XS)", _columns("xb", "st + 1", "(st + 1)", "XS", 12)),
    "h a (1, 2)": ("            xa = gl.load(xr + gl.where(st + 2 < STEPS, st + 2, 0) * XS)",
                   _columns("xa", "st + 2", "gl.where(st + 2 < STEPS, st + 2, 0)", "XS", 12)),
    "words a (4)": (_DN_W[0], guard(_DN_W[0], 4, "wa, sa = _w_at(wr, sr, st % 2, STEPS, NWT)", indent=12)),
    "words b (4)": (_DN_W[1], guard(_DN_W[1], 4, "wb, sb = _w_at(wr, sr, (st + 1) % 2, STEPS, NWT)", indent=12)),
}


def t64_ablation(base: dict, case, parts, compiled, stats) -> None:
    """Each bit set of MOE_BENCH_T64_ABLATE_BITS, gate-up then down alone (`parts(cfg, case, kernels)`, ms), rounds
    alternated; recorded as t64_ablate_<kernel>_<bits>_r<round> with the registers, spills and K-loop SASS of a
    variant compiled for it (`stats(compiled())`: _moe_t64.kernel_stats). MOE_BENCH_T64_ABLATE_CFG: a JSON object of
    config overrides (e.g. '{"GGR": 0}': the gate-up without its register cap)."""
    up = AblatedLaunch(ablated_module(gg_gluon, GATE_UP_EDITS, "moe_ablation")._grouped_gate_up_kernel)
    dn = AblatedLaunch(ablated_module(gd_gluon, DOWN_EDITS, "moe_ablation")._grouped_down_kernel)
    keep = gg_gluon._grouped_gate_up_kernel, gd_gluon._grouped_down_kernel
    gg_gluon._grouped_gate_up_kernel, gd_gluon._grouped_down_kernel = up, dn
    bits = [int(b) for b in os.environ.get("MOE_BENCH_T64_ABLATE_BITS", "0,1,2,4,8,6,12,14,5").split(",")]
    cfg = {**base, **json.loads(os.environ.get("MOE_BENCH_T64_ABLATE_CFG", "{}"))}
    try:
        for rnd in range(int(os.environ.get("MOE_BENCH_T64_ABLATE_ROUNDS", 2))):
            for b in bits:
                up.abl = dn.abl = b
                for kernel in ("gate_up", "down"):
                    try:
                        before = compiled()
                        t = parts(cfg, case, (kernel,))
                        record(f"t64_ablate_{kernel}_{b}_r{rnd}", t, abl=b, round=rnd, config=cfg,
                               kernels=stats(before), timing="cuda graph, distinct routings")
                    except Exception as e:
                        DOC["errors"].append({"section": f"t64_ablate_{kernel}_{b}",
                                              "error": f"{type(e).__name__}: {str(e)[:300]}"})
    finally:
        gg_gluon._grouped_gate_up_kernel, gd_gluon._grouped_down_kernel = keep
