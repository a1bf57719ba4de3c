"""Named configs, the split-K rule and the config legality (`constraints`) of the routed experts' kernel
family `moe_grouped_gemm` (moe_grouped_gemm.py: kernels, host launches, `heuristic`, the template; the
tables here are the heuristic's, measured on the H200, see its docstring). Re-exported by moe_grouped_gemm.
"""

from __future__ import annotations

from codegen.triton._moe_host import target_cc

BATCH_INVARIANT_CONFIG = {"BM": 64, "BN": 64, "BK": 64, "BN2": 64, "BK2": 64, "num_warps": 4, "num_stages": 3,
                          "GROUP_M": 8, "SPLIT": 1}
GEMV_MAX_PAIRS = 16        # routed pairs up to which the per-pair path runs (heuristic), with the GEMV_T1 tiles
# per-pair tiles measured best on the H200 (session 7, bench_moe.py, graph replay, l=3584, I=3072, MXFP4, PDL on;
# _moe_gemv.py's GV=2 kernels): T=1 top-2: gate-up 4 rows x 1024 columns a step on 2 warps, down 8 x 1024 on 1
# warp: 27.7 us (3.4x the 8.2 us byte floor; session 6's GEMV_FFMA_S6 38.4, its 8 x 1024 / 8 x 512 on 4 warps
# 30.4). T=8 top-2 (16 pairs), the lead's final call: the same tiles 168.3 us (3.3x) vs GEMV_T8 (8 x 1024 on 4
# warps, down 8 x 512, the helper's best of its first sweep at 183.7) 186.3 in the same run; session 6 204.1.
GEMV_T1 = {"GV": 2, "GN": 4, "GK": 1024, "GN2": 8, "GK2": 1024, "GW2": 1, "PREF": 1, "XV": 1, "HX": 1, "GMMA": 0,
           "num_warps": 2, "num_stages": 1}
# the previous configurations, kept callable: session 7's first T=8 tiles, session 6's T=1 FFMA and T=8
# MMA-step tiles (GV=1 kernels)
GEMV_T8 = {"GV": 2, "GN": 8, "GK": 1024, "GN2": 8, "GK2": 512, "GW2": 4, "PREF": 1, "XV": 1, "HX": 1, "GMMA": 0,
           "num_warps": 4, "num_stages": 1}
GEMV_FFMA_S6 = {"GV": 1, "GN": 8, "GK": 1024, "GN2": 8, "GK2": 1024, "GW2": 0, "GMMA": 0, "num_warps": 4,
                "num_stages": 1}
GEMV_MMA_S6 = {"GV": 1, "GN": 16, "GK": 128, "GN2": 16, "GK2": 128, "GW2": 0, "GMMA": 1, "num_warps": 1,
               "num_stages": 4}
GEMV_TILES = {k: v for k, v in GEMV_T1.items() if k not in ("num_warps", "num_stages")}
GPU_SLOTS = 528             # 4 decode programs on each of the H200's 132 SMs (219 registers a thread)
DECODE_MAXNREG = 168        # the cap that fits 6 when the programs fill several waves (T=64: 1.11 vs 1.16 ms)


def decode_split(programs: int, k_steps: int, most: int = 8) -> int:
    """K slices per output tile: doubled while the programs still fit GPU_SLOTS and every slice keeps at
    least 4 K steps (measured on the H200: 4 at T=1 top-2 of 112 experts, 1 at T=64 top-16)."""
    s = 1
    while 2 * s <= most and programs * 2 * s <= GPU_SLOTS and k_steps >= 4 * 2 * s:
        s *= 2
    return s


def constraints(config: dict, key: dict, target=None) -> list[str]:
    out = []
    mx = key["MX"]
    for bk in ("BK", "BK2"):
        if mx and config[bk] % 32:
            out.append(f"{bk}={config[bk]} must be a multiple of the MXFP4 block (32)")
    if config["DEQ"] in ("dot_scaled", "asm", "asm16"):
        cc = target_cc(target)
        if not (mx and key["BF16"]):
            out.append(f"DEQ={config['DEQ']} needs MXFP4 weights and bf16 activations")
        if cc is None or cc < 90:
            out.append(f"DEQ={config['DEQ']} needs a CUDA target of compute capability >= 9.0, found {cc}")
    if key.get("BI") and any(config.get(k, 1 if k == "SPLIT" else None) != v for k, v in BATCH_INVARIANT_CONFIG.items()):
        out.append("batch_invariant: tiles are fixed to BATCH_INVARIANT_CONFIG (no split-K)")
    if key.get("BI") and config.get("PATH", "grouped") != "grouped":
        out.append("batch_invariant: the grouped path (PATH='grouped') with BATCH_INVARIANT_CONFIG")
    if config.get("GASM") and target_cc(target) is None:
        out.append("GASM=1 (inline PTX decode) needs a CUDA target")
    for g in ("GN", "GK", "GN2", "GK2"):
        v = config.get(g, 16)
        if v < 1 or v & (v - 1) or (g.startswith("GK") and mx and v < 8):
            out.append(f"{g}={v} must be a power of two (GK, GK2 >= 8 for MXFP4 words)")
    if config.get("SL", 0) not in (0, 1, 2, 3):
        out.append(f"SL={config['SL']} must be 0 (scales read in the step), 1 (at its top), 2 (int32 words), "
                   "3 (a step ahead)")
    for name, allowed in (("GV", (1, 2)), ("PREF", (0, 1)), ("XV", (0, 1)), ("HX", (0, 1))):
        if config.get(name, allowed[-1]) not in allowed:
            out.append(f"{name}={config[name]} must be one of {allowed} (per-pair path, _moe_gemv.py)")
    if key.get("BI") and config.get("SPLIT2", 1) != 1:
        out.append("batch_invariant: no split-K (SPLIT2 must be 1)")
    # per stage: the activation tile (twice for MXFP4: as loaded and split into even/odd columns) and the
    # w1, w3 tiles (MXFP4 half a byte per element, bf16 weights two)
    stage = config["BM"] * config["BK"] * 2 * (2 if mx else 1) + config["BN"] * config["BK"] * (1 if mx else 4)
    smem = config["num_stages"] * stage
    if smem > 220 * 1024:
        out.append(f"gate-up pipeline needs ~{smem // 1024} KiB of shared memory (> 220)")
    return out
