"""What benches/bench_kda.py measures: the prefill configs (kernel-2 tiles, kernel-1 variants over the sessions 5-7
heuristic) and the fused-decode candidates per case, with the measurements that chose them, and the warm-up jobs.
"""

from __future__ import annotations

import os

from _kda_bench_inputs import B_DEC, DEV, H, H_RANK, D, dec

from codegen.triton.kda_decode import heuristic as decode_heuristic

# previous = the heuristic of sessions 5-7 (benches/results/h200-2026-11-29-s6/kda_helper.json)
PREV_PREFILL = {"BK": 64, "BV_INTRA": 64, "WARPS_INTRA": 4, "STAGES_INTRA": 2, "BV": 32, "WARPS": 4, "STAGES": 3,
                "SPLIT_INTRA": 0, "LOWP_A": 1, "LOWP_WU": 1}
SWEEP = os.environ.get("KDA_BENCH_SWEEP") == "1"  # adds s8 round 2's variants (s8/kda_round2.json: all slower)
# kernel 2 (BV, WARPS, STAGES), timed at B=4 (ms, s8 r2; heuristic 128 x 4 x 2: 0.519): 64 x 4 x 1 0.706, 128 x 4 x 1
# 0.850, 64 x 8 x 1 1.312; s8: 128 x 8 x 2 0.634, 32 x 4 x 3 1.036; 64 x 4 x 3 0.570
STATE_VARIANTS = [(64, 4, 1), (128, 4, 1), (64, 8, 1)] * SWEEP + [(128, 4, 2), (64, 4, 3), (64, 4, 2)]
# kernel 1 over the heuristic's config, timed at B=4 (ms; heuristic BK 64, BV_INTRA 64, 4 warps, 2 stages: 2.684;
# s8: 1 stage 2.862, BK 32 x 1 stage 3.432, BV_INTRA 128 2.853 / 32 2.992, BK 32 + BV_INTRA 128 2.827, 2 warps 5.281,
# 8 warps 4.67, BK 128 x 8 warps 4.91, 3 stages 4.23). Session 10 (checked in bf16 at B=1 8K, not yet timed): kernel 1
# in 64-row form (A64, `_kda_intra64.py`) and register caps for 3-4 programs per SM (MAXNREG_INTRA); ptxas sm_90
# (Triton 3.7, locally) registers / spill stack bytes: heuristic 255 / 384; A64 BK/BV_INTRA 32/64 255 / 64, 32/32
# 255 / 16, 16/32 at 168 / 128, 16/16 at 168 / 88, 32/32 at 168 / 224, 16/16 at 128 / 248; BK 32/32 at 168 / 184
_INTRA_KEYS = ("BK", "BV_INTRA", "WARPS_INTRA", "STAGES_INTRA", "MAXNREG_INTRA", "A64")
_A = {"A64": 1}  # STAGES_INTRA 1 with A64: an illegal memory access on the H200 (Triton 3.6; `constraints` rejects it)
INTRA_VARIANTS = [{**_A, "BK": bk, "BV_INTRA": bv, "MAXNREG_INTRA": cap} for bk, bv, cap in (
    (32, 64, 0), (32, 32, 0), (16, 32, 168), (16, 16, 168), (32, 32, 168), (16, 16, 128))] + \
    [{"BK": 32, "BV_INTRA": 32, "MAXNREG_INTRA": 168}] + \
    [{"STAGES_INTRA": 1}, {"BK": 32, "STAGES_INTRA": 1}, {"BV_INTRA": 128}, {"BK": 32, "BV_INTRA": 128}] * SWEEP


# (B, heads, tokens per request, new candidates, previous ones (the heuristic first)); earlier sessions' slower B=64
# variants (kda_decode.heuristic's docstring; s9: split 2 / 4 with the gate GEMM, EARLY or not, 130.7-166.9 us vs
# 88.2; 8 warps 137.6) come back with KDA_BENCH_SWEEP=1. s10: 1-2 warp programs (checked, not timed) compiled to
# 254-255 registers with 26-192 spills (BV/warps 32/2, 64/2, 16/1, 32/1): no more warps per SM, left out.
# s11 (benches/results: the KDA helper's kda.json of session 11), B=64 H=32 µs per launch, PDL on: the state blocks
# through shared memory (cp.async by Triton's loop pipeliner, register caps for 3-4 programs per SM; 128-168 registers,
# 0 spills, 33-67 KB shared) were all slower than the heuristic's 87.96: BV 32 x 4 / 5 stages at 168 registers 111.6 /
# 108.9, uncapped 124.9; BV 16 x 3 / 5 / 7 stages at 128 registers 136.6 / 132.6 / 136.1, at 168 144.3, GEMV gate
# 150.8; the kernel code was removed. Both state blocks loaded before the front (registers: 1656 spill bytes) was not
# run. Batch 1, one program per head (no split-V counter): 8 warps 8.32 / 8.91 us (H=12 / H=32), 16 warps 11.15 /
# 11.85, split 2 x 8 warps 8.09 / 8.71, vs the heuristic's 6.44 / 7.10: under KDA_BENCH_SWEEP=1
_ONE_BLOCK = [dec(1, 128, warps=8), dec(1, 128, warps=16), dec(2, 64, warps=8)] * SWEEP
# s11b (benches/results/h200-2026-11-30-s11/kda_stream.json): a streaming kernel ([BK, BV] chunks of the state in two
# passes; removed, see kda_decode.heuristic) took 127.6-328 us at B=64 H=32 vs the heuristic's 88.19. The state copy
# ceiling (bench_kda.py `state_copy_ceiling`): (BV, stages, warps); s11b µs: 64/0/4 70.78, 128/0/8 73.39, 64/3/8
# 70.83; that kernel's two-pass pattern (each block read twice in [32, BV] chunks) took 85.85 (BV 64) - 105.3 (BV 128)
# s13 (benches/results/h200-2026-11-30-s13/kda_decode_wk_helper.json), µs: (BV, stages, warps, CS: streaming stores)
# 64/0/4/0 70.83, 64/0/4/1 69.65, 128/0/8/0 73.77, 64/3/8/0 70.51; written to a second pool 71.62; the warp-owns-
# columns tile (8 rows x 64 bytes a warp access) 101.8, with CS 98.44, BV 32 132.6 (removed)
COPY_VARIANTS = [(64, 0, 4, 0), (64, 0, 4, 1), (128, 0, 8, 0), (64, 3, 8, 0)]
# s13: WK (warp-owned state columns), streaming state stores, EARLY with two blocks at B=64: all slower (numbers in
# kda_decode.heuristic; the code removed); the hoisted one-token broadcasts (the default now) 88.70 vs 88.97
# s16: the persistent TMA-ring Gluon kernel (`_kda_decode_gluon.py`, GLUON=1; its module docstring has the numbers of
# the variants measured and removed: round 1's whole-state boxes (2 / 3 stages, 4 columns a thread, the refill at a
# pair's end, 8 warps), round 2's column halves in a 3-box ring with two programs per SM)
# s16 round 3 (kda_decode._GLUON_VARIANTS): the gate f = f_a f_b^T inside the Gluon kernel (GLUON 2, the default; the
# ring one box shorter for f_b's head rows) vs the gate GEMM first (GLUON 1); its rank loop at 4 / 16 groups an
# iteration and the GEMM with the shorter ring were slower (numbers in kda_decode._GLUON_VARIANTS' comment)
# s17: GLUON 3, the in-kernel gate on a head-aligned grid (`_kda_decode_gluon.grid`: 128 programs at B=64 H=32, each
# loading its head's f_b rows once instead of 32 KB a pair)
_GLUON = [dec(1, 64, 32, early=0, gate_mm=1, gluon=1), dec(1, 64, 32, early=0, gluon=2),
          dec(1, 64, 32, early=0, gluon=3)]
DECODE_CASES = [
    (B_DEC, H, 1, _GLUON + [dec(2, 64, gate_mm=1), dec(2, 64, early=0, gate_mm=1), dec(4, 32, gate_mm=1), dec(2, 64),
                            dec(1, 64, 32, early=0, gate_mm=1, warps=8), dec(1, 64, 32, early=0, gemv=1)] * SWEEP,
     [dec(1, 64, 32, early=0, gate_mm=1)]),
    (1, H_RANK, 1, _ONE_BLOCK + [dec(8, 16, early=0)] * SWEEP, [dec(4, 32)]),
    (1, H, 1, _ONE_BLOCK + [dec(2, 64)] * SWEEP, [dec(4, 32)]),
    (B_DEC, H, 8, [], [dec(1, 64, 32, early=0)]),
    # s17: below the Gluon kernel's 2048 pairs, GLUON 3 vs the heuristic's Triton kernel: the rank preset at batch 64
    # (768 pairs, 132 programs of one head each) and 32 requests of 32 heads (1024 pairs, 128 programs)
    (B_DEC, H_RANK, 1, _GLUON[2:], []),
    (B_DEC // 2, H, 1, _GLUON[2:], [])]


def state_configs():
    """Kernel-2 tiles and kernel-1 variants (over the previous config), as (kind, full config)."""
    state = [{**PREV_PREFILL, "BV": min(bv, D), "WARPS": w, "STAGES": st} for bv, w, st in STATE_VARIANTS]
    return [("state", c) for i, c in enumerate(state) if c not in state[:i]] + \
        [("intra", {**PREV_PREFILL, **v, "BK": min(v.get("BK", 64), D)}) for v in INTRA_VARIANTS]


def decode_candidates(B, heads, qlen, new, previous):
    """New candidates, then the previous ones (the first: the session-8 heuristic), then the heuristic if not among
    them; returns (candidates, heuristic, index of the previous heuristic)."""
    heur = decode_heuristic({"D": D, "H": heads, "R": B, "T": B * qlen}, DEV)
    heur = {k: v for k, v in heur.items() if k != "GLUON" or v}  # GLUON 0: as the candidates without the key
    cands = [{**c, "BV": min(c["BV"], D // c["SPLIT"])} for c in new + previous]
    return cands + ([heur] if heur not in cands else []), heur, len(new)


def decode_jobs():
    """(B, heads, qlen, config, pdl) the decode warm-ups compile: every candidate with PDL on, and with PDL off the
    previous heuristic and the first new candidate."""
    jobs = []
    for B, heads, qlen, new, prev in DECODE_CASES:
        cands, _, i_prev = decode_candidates(B, heads, qlen, new, prev)
        jobs += [(B, heads, qlen, c, pdl) for j, c in enumerate(cands) for pdl in (True, False)
                 if pdl or j in (0, i_prev)]
    return jobs
