"""Named configs, the split-K rule and the config legality (`constraints`) of the routed experts' kernel
family `moe_grouped_gemm` (moe_grouped_gemm.py: kernels, host launches, `heuristic`, the template; the
tables here are the heuristic's, measured on the H200, see its docstring). Re-exported by moe_grouped_gemm.
"""

from __future__ import annotations

from codegen.triton._moe_host import target_cc

BATCH_INVARIANT_CONFIG = {"BM": 64, "BN": 64, "BK": 64, "BN2": 64, "BK2": 64, "num_warps": 4, "num_stages": 3,
                          "GROUP_M": 8, "SPLIT": 1}
GEMV_MAX_PAIRS = 16        # routed pairs up to which the per-pair path runs (heuristic), with the GEMV_T1 tiles
# per-pair tiles measured on the H200 (bench_moe.py decode, graph replay of 8 distinct routings, l=3584, I=3072,
# MXFP4, PDL on; _moe_gemv_words' GV=2 kernels). Session 9 (one run:
# benches/results/h200-2026-11-30-s9/moe_decode_t1_s9.json):
# T=1 top-2, us (floor 8.17): session 8's tiles (GEMV_S8) 27.62, + EARLY 1 (the down kernel reads its expert id
# and first weight step before the PDL wait) 26.18, + EARLY 3 (the gate-up kernel too) 25.17; EARLY 3 with
# gate-up 4 x 512 on 1 warp 22.77 (23.16 again, graph replay bitwise equal to eager; PDL off 26.22), 8 x 512 on
# 2 warps 24.24, 2 x 1024 on 1 warp 29.23; down 16 x 1024 on 2 warps 25.58, 4 x 1024 26.62, 8 x 2048 50.6 (270
# spills); register caps 128 / 96 43.5 / 67.0 (spills). Apart (graph replay): gate-up 16.13 -> 12.57, down
# 11.98 -> 10.73 (the down kernel: 255 registers, 4 spilled, at 8 x 1024 on 1 warp). T=8 top-2: GEMV_S8 168.67,
# + EARLY 1 166.7, + EARLY 3 167.98. GEMV_T1 below takes EARLY 1 only, whose reads are legal by construction; EARLY
# 3 (~1 us more a call at T=1) is legal only where the router ran two or more launches before the experts node
# (the rank graph's router -> packed_linear -> experts order): a schedule property the op cannot check.
# The lead's run (benches/results/h200-2026-11-30-s9/moe_decode_gv3.json, MOE_BENCH_DECODE_SHAPES=1x2,8x2):
# GEMV_T1 as below T=1 24.29 us (2.97x; PDL off 26.18), T=8 151.8 (2.97x; session 8's tiles 169.0, + EARLY 1
# 168.0, EARLY 3 149.3); EARLY 3 at T=1 23.02, with 16-row down tiles on 2 warps 22.74. A tensor-core gate-up
# (GV=3: weights decoded to bf16 pairs by PTX, mma.sync / wgmma against the activation column padded to 16,
# K split with an in-launch combine) measured 38.2-56.7 us at T=1 over five tilings and 241 at T=8: removed.
# Session 11 (benches/results/h200-2026-11-30-s11/moe_decode_gv4.json): GV=2 at T=1 top-2 24.06-24.14 us (2.93-2.95x
# the floor; PDL off 26.3-27.4), EARLY 3 22.7-23.1; gate-up alone 13.8-14.2, down alone 10.8-11.0; T=4 81.7-82.6;
# T=8 149.7-151.4. What bounds it (sm_90 SASS of GEMV_T1): gate-up ~42 instructions a word, 157 registers, 11.6
# one-warp programs an SM: ~7.5 us of issue vs 5.5 of bytes; down ~40 a word, 255 registers + spills, 6.8 programs
# an SM each a serial chain of three 1290-instruction steps, ~27 KB in flight an SM (latency bound). A GV=4 form
# (each lane decodes one word into bf16 pairs for one mma.sync.m16n8k16, ~27 instructions a word, 70 registers, K
# split over programs with the in-launch combine) was exact but slower: T=1 31.4-41.8 us over 9 tilings, T=4
# 95.1-142.5, T=8 158.1-194.8: removed.
GEMV_T1 = {"GV": 2, "GN": 4, "GK": 512, "GN2": 8, "GK2": 1024, "GW2": 1, "PREF": 1, "XV": 1, "HX": 1, "GMMA": 0,
           "EARLY": 1, "num_warps": 1, "num_stages": 1}
# session 8's tiles (T=1 27.7 us, T=8 168.3), and them with the down kernel's early reads (T=8: 166.7 us, the
# measured best legal config at T=8)
GEMV_S8 = {"GV": 2, "GN": 4, "GK": 1024, "GN2": 8, "GK2": 1024, "GW2": 1, "PREF": 1, "XV": 1, "HX": 1, "GMMA": 0,
           "EARLY": 0, "num_warps": 2, "num_stages": 1}
GEMV_S8_EARLY = {**GEMV_S8, "EARLY": 1}
# the previous configurations, kept callable: session 7's first T=8 tiles (186.3 us at T=8), session 6's T=1 FFMA
# and T=8 MMA-step tiles (GV=1 kernels)
GEMV_T8 = {"GV": 2, "GN": 8, "GK": 1024, "GN2": 8, "GK2": 512, "GW2": 4, "PREF": 1, "XV": 1, "HX": 1, "GMMA": 0,
           "num_warps": 4, "num_stages": 1}
GEMV_FFMA_S6 = {"GV": 1, "GN": 8, "GK": 1024, "GN2": 8, "GK2": 1024, "GW2": 0, "GMMA": 0, "num_warps": 4,
                "num_stages": 1}
GEMV_MMA_S6 = {"GV": 1, "GN": 16, "GK": 128, "GN2": 16, "GK2": 128, "GW2": 0, "GMMA": 1, "num_warps": 1,
               "num_stages": 4}
GEMV_TILES = {k: v for k, v in GEMV_T1.items() if k not in ("num_warps", "num_stages")}
GPU_SLOTS = 528             # 4 decode programs on each of the H200's 132 SMs (219 registers a thread)
DECODE_MAXNREG = 168        # the cap that fits 6 when the programs fill several waves (T=64: 1.11 vs 1.16 ms)
# grouped decode that fills the GPU with asm16 (T=64 top-16): the gate-up and down kernels tuned apart (the down
# kernel's own warps / stages / cap: num_warps2, num_stages2, MAXNREG2). H200 session 10 (bench_moe.py t64, graph
# replay, one run, ms; benches/_moe_t64.py): whole op 1.055 with session 8's SL 3 / BK 64 / 4 stages / cap 168 /
# BN2 128 -> 1.010 with this (40.0% of read bandwidth, graph replay bitwise equal to eager; PDL off 1.006).
# Gate-up alone 0.691: cap 128 with 3 stages 0.684 (cap 128 / 4 stages 0.704, uncapped 0.703 (ptxas takes 128),
# 144 0.700, 112 0.713 (spills), 6 stages 0.808, SL 1 0.777, BN 32 x BK 128 0.785, 4-warp wgmma 0.887-0.897).
# Down alone 0.352: BN2 64 at a 96 cap 0.341 (10 programs an SM; BN2 128 uncapped 0.354, cap 128 0.352, 6 stages
# 0.398, 4-warp wgmma 0.396). Both sit near the access pattern's ceiling: the weights alone read with the gate-up's
# grid and 32 bytes a row a K step move 2.32 TB/s (0.602 ms for its bytes; 64 bytes 2.55-2.76, 128 bytes 4.10),
# and Nsight Compute puts L2 tag lookups at 67% (gate-up) / 76% (down) of peak, the ALU pipe at 63% / 51%, issue
# slots 53% / 54% (session 8's config: ~460 SASS instructions per warp per K step of 2x64x64 weights, 3.5 per
# element, 2.25 of them the decode). So 60% needs weight rows requested ~128 bytes at a time AND fewer ALU
# instructions per element (at this count the ALU pipe alone binds at ~0.6 ms).
# The same session's second run (benches/results/h200-2026-11-30-s10/moe_t64_run2.json): this config 1.012, with the
# decode's left shifts as IMADs (DEQ asm16i, _moe_decode16.py) 0.997 (gate-up 0.659 -> 0.640; wide-scale check ok);
# K steps unrolled (KU 2 / 4) 1.06-1.18 (slower), 32-token tiles 1.152, the down kernel's KU 2 / 3 stages 1.005.
# Session 12 (benches/results/h200-2026-11-30-s12/moe_t64_whole_lines.json; this config, its down kernel at 3 stages /
# cap 128: 0.9997 and 1.0086 ms, 39.6% / 39.3%; gate-up alone 0.643, down 0.344): whole 128-byte weight lines a K step
# (BK / BK2 256, 2-8 warps, wgmma or mma.sync) 1.16-1.82 ms, BK 128 1.016-1.088, GROUP_M 1 / 32 0.995 / 1.011: the
# same ~3.7 instructions per weight element on fewer warps an SM (latency). With the context's L2 fetch
# granularity at 128 bytes (default 64) the 32-byte-a-row read pattern alone went 2.52 -> 3.53 TB/s but the op only
# 0.989 ms: at this instruction count the HBM pattern is not the binding limit; issue and latency are.
# Session 14 (benches/results/h200-2026-11-30-s14/moe_t64_tma.json; the config before: 1.0027 / 0.9963 ms, PDL off
# 0.9943, gate-up alone 0.660, down 0.330): the gate-up's packed weights by TMA (TMA 1: bulk tensor copies of
# [64, 2, 8] int16 blocks, mbarrier-pipelined, 116 registers instead of 128) with its scale bytes read at the top
# of the step (SL 1; the down kernel keeps SL 3: SL2). As below (cap 104: 9 programs an SM) 0.9513 ms (42.5% of read
# bandwidth) and 0.9770, PDL off 0.9470, graph replay bitwise equal to eager, wide-scale check ok, gate-up alone
# 0.632; at the 128 cap 0.9467, gate-up alone 0.641. Slower (gate-up alone): 4 stages 0.692, cap 104 / 4 stages
# 0.664, 6 stages 0.750, SL 2 (scale words by cp.async) 0.643, BK 128 / 4 stages 0.741, PF 0.791. The down kernel by
# TMA (SL 1) 0.364, cap 80 0.353, SL 2 0.367, 6 stages 0.381, cap 80 / 6 stages 0.383, BK2 128 0.374: all above its
# 0.330 (removed).
DECODE_T64 = {"DEQ": "asm16i", "SL": 1, "TMA": 1, "SL2": 3, "BK": 64, "BK2": 64, "num_stages": 3, "MAXNREG": 104,
              "BN2": 64, "num_warps2": 2, "num_stages2": 4, "MAXNREG2": 96}
# session 15: the Gluon grouped gate-up's best tiling (GG, _moe_grouped_gluon.py; the heuristic's at T=64 on top of
# DECODE_T64): gate-up alone 0.613 vs DECODE_T64's 0.616 in the same call, whole op 0.954-0.956 vs 0.944 at the
# driver's 64-byte L2 fetches; 0.891 vs 0.942 at the 128 bytes the runtime sets (k31c/runtime/l2_fetch.py).
# Session 16 (benches/results/h200-2026-11-30-s16/moe_t64_down_gluon_call2.json): + GGU (the gate-up's words two steps
# ahead, _moe_grouped_gluon.py) and the Gluon down kernel (GD, _moe_down_gluon.py: W4 x MT2, words two steps ahead,
# h in its operand order): whole op 0.860 ms (47.0% of read bandwidth; PDL off 0.862; 0.864 at 128-byte L2 fetches)
# vs session 15's GLUON_T64 0.988 / 0.995 (0.912 at 128 bytes) in the same call; gate-up alone 0.573 vs 0.641, down
# alone 0.290 vs the Triton kernel's 0.332
# Session 23 (benches/results/h200-2026-12-02-s23/moe_t64_gdo*.json): + GDO (the down kernel starts on each expert as
# that expert's gate-up programs finish, `_moe_down_gluon._await_expert`, filling the gate-up's last wave: 5376
# programs on 528 slots): whole op 0.843 vs 0.860 / 0.863 in the same call, the same bits; four alternated pairs on a
# noisier machine (moe_t64_gdo_pairs.json) faster in each, medians 0.862 vs 0.888
GLUON_T64 = {"GG": 1, "GGW": 4, "GGM": 1, "GGN": 4, "GGB": 16, "GGD": 1, "GGR": 128, "GGU": 1,
             "GD": 1, "GDW": 4, "GDM": 2, "GDN": 4, "GDB": 16, "GDO": 1}


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
    if config["DEQ"] in ("dot_scaled", "asm", "asm16", "asm16i"):
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
    if config.get("GLUON") and (target_cc(target) or 0) < 90:
        out.append("GLUON=1 (the Gluon tensor-core gate-up, _moe_gemv_gluon.py) needs a CUDA target of cc >= 9.0")
    if config.get("GG") and (target_cc(target) or 0) < 90:     # the Gluon grouped gate-up, _moe_grouped_gluon.py
        out.append("GG=1 (the Gluon grouped gate-up, _moe_grouped_gluon.py) needs a CUDA target of cc >= 9.0")
    if config.get("GD") and (target_cc(target) or 0) < 90:     # the Gluon grouped down, _moe_down_gluon.py
        out.append("GD=1 (the Gluon grouped down, _moe_down_gluon.py) needs a CUDA target of cc >= 9.0")
    if config.get("LATE", 0) not in (0, 1):
        out.append(f"LATE={config['LATE']} must be 0 or 1 (the gate-up launched without its programmatic edge)")
    if config.get("EARLY", 0) not in (0, 1, 2, 3):
        out.append(f"EARLY={config['EARLY']} must be 0..3 (bit 0: the down kernel's early reads, bit 1: gate-up's)")
    for ku, split in (("KU", "SPLIT"), ("KU2", "SPLIT2")):
        if config.get(ku, 1) not in (1, 2, 4):
            out.append(f"{ku}={config[ku]} must be 1, 2 or 4 (K steps an iteration)")
        elif config.get(ku, 1) > 1 and config.get(split, config.get("SPLIT", 1)) > 1:
            out.append(f"{ku}={config[ku]} needs an unsplit K ({split}=1)")
    if config.get("TMA", 0) not in (0, 1):      # the gate-up's weights by TMA (moe_grouped_gemm._tma_desc)
        out.append(f"TMA={config['TMA']} must be 0 or 1 (the gate-up's packed weights read by TMA)")
    elif config.get("TMA"):
        cc = target_cc(target)
        if cc is None or cc < 90 or key.get("BI") or not mx or config["DEQ"] not in ("asm16", "asm16i", "bytes16"):
            out.append(f"TMA=1 needs a CUDA target >= 9.0 (found {cc}), MXFP4 weights with a 16-bit-word decode "
                       f"(DEQ {config['DEQ']}) and no batch-invariant mode")
        if config.get("SL", 0) not in (1, 2):
            out.append("TMA=1 needs SL 1 or 2 (with SL 3's carried scale bytes Triton 3.6 sends the decoded tile "
                       "through shared memory)")
    if config.get("SL2", 0) not in (0, 1, 2, 3):
        out.append(f"SL2={config['SL2']} must be 0..3 (the down kernel's SL)")
    for cap in ("MAXNREG", "MAXNREG2"):
        if config.get(cap) and not 32 <= config[cap] <= 255:
            out.append(f"{cap}={config[cap]} must be 0 (no cap) or 32..255 registers")
    if config.get("GREG"):
        if target_cc(target) is None:
            out.append("GREG (a register cap) needs a CUDA target")
        elif not 32 <= config["GREG"] <= 255:
            out.append(f"GREG={config['GREG']} must be 0 (no cap) or 32..255 registers")
    if key.get("BI") and config.get("SPLIT2", 1) != 1:
        out.append("batch_invariant: no split-K (SPLIT2 must be 1)")
    # per stage: the activation tile (twice for MXFP4: as loaded and split into even/odd columns) and the
    # w1, w3 tiles (MXFP4 half a byte per element, bf16 weights two)
    stage = config["BM"] * config["BK"] * 2 * (2 if mx else 1) + config["BN"] * config["BK"] * (1 if mx else 4)
    smem = config["num_stages"] * stage * config.get("KU", 1)
    if smem > 220 * 1024:
        out.append(f"gate-up pipeline needs ~{smem // 1024} KiB of shared memory (> 220)")
    return out
