"""Issue 5's decode target, T=64 tokens top-16 of 112 experts (MXFP4, l=3584, I=3072): the `t64` section of
bench_moe.py. The grouped path's gate-up and down kernels are swept apart (each variant changes one kernel's
tiles, warps, stages or register cap; the other keeps the heuristic's), every variant checked as the whole op
against the fp32 reference, then timed under CUDA-graph replay as the whole op and as its own kernel alone;
per compiled kernel: registers, spills and the SASS of its K loop (instructions per opcode). Then the best
gate-up with the best down as the whole op (PDL on, graph replay checked bitwise against eager, PDL off), and
a read-pattern probe: the gate-up's weight reads alone (BN rows x BK/2 bytes a K step of w1 and w3, the same
grid and raster, plain 16-byte loads, no decode; also 32-byte pieces four to an iteration, and with an L2
prefetch of each row's next line), which separates the memory system's ceiling for that access pattern from
the kernel's instruction stream; the whole op and the probe again with the context's L2 fetch granularity at 128
bytes (`l2_fetch_check`). The variant tables are empty until a new variant is written: the measured ones, with
their numbers, are in the comments above them.

    MOE_BENCH_SECTIONS=t64 MOE_BENCH_DECODE_DEADLINE=140 python benches/bench_moe.py   # ~25-60 s on the H200
    MOE_BENCH_T64_DEADLINE=120: seconds into the run after which no further variant is started
    MOE_BENCH_T64_PROBES=0: skip the read-pattern probe and the L2 fetch-granularity check (session 12's figures)
    MOE_BENCH_T64_GG=1: also the Gluon gate-up (_moe_configs.GLUON_T64), at 128-byte L2 fetches too
    MOE_BENCH_T64_PATTERN=0: no read-pattern probe (the whole op at 128-byte L2 fetches still runs, PROBES=1)
    MOE_BENCH_T64_ABLATE=1: the Gluon kernels with parts taken out, each alone (_moe_ablation.py)
    MOE_BENCH_T64_GDO=N: N alternated pairs of the whole op without / with config GDO
Every config also runs a skewed routing (expert 0 in every token) against the float64 reference (`skew_check`).
"""

from __future__ import annotations

import itertools
import os
import time

import torch
from _moe_common import ACT, B1, B2, DEV, DOC, E, ELL, INTER, REPORT, TINY, W, gg, graph_ms, mr, record, tl, triton
from _moe_decode import _SASS_OPS, _sass_ops, decode_case, decode_variant

from codegen.triton import _moe_configs as mc
from codegen.triton._moe_tiles import _swizzle
from k31c.runtime.l2_fetch import l2_fetch_granularity

T64, K64 = (8, 2) if TINY else (64, 16)
DEADLINE = float(os.environ.get("MOE_BENCH_T64_DEADLINE", 120))
PROBES = os.environ.get("MOE_BENCH_T64_PROBES", "1") == "1"     # 0: no read-pattern probe / L2 fetch check
PATTERN = os.environ.get("MOE_BENCH_T64_PATTERN", "1") == "1"   # 0: no read-pattern probe
# the down kernel's own keys, so a gate-up variant's num_warps / num_stages / MAXNREG leave it as the heuristic's
_DOWN_KEYS = {"num_warps2": "num_warps", "num_stages2": "num_stages", "MAXNREG2": "MAXNREG"}

# gate-up variants (overrides of the heuristic's config, _moe_configs.DECODE_T64). Session 10's sweep (H200, one run,
# gate-up alone under graph replay, ms; whole op in brackets), relative to session 8's SL 3 / BK 64 / 4 stages /
# cap 168 (155 regs): 0.691 [1.055]; cap 128 with 3 stages (the new heuristic) 0.684 [1.027]; cap 128 / 4 stages
# 0.704, uncapped (ptxas takes 128) 0.703, cap 144 0.700, cap 112 0.713 (spills), cap 128 / 6 stages 0.808, SL 1
# 0.777, BN 32 x BK 128 0.785, 4-warp wgmma BN 64 x BK 128 0.897 / BN 128 0.888. Its second run
# (moe_t64_run2.json, gate-up alone): DEQ asm16i 0.640 (now DECODE_T64's), KU 2 0.811, KU 4 / 2 stages 0.797 (uncapped
# 0.723, with asm16i 0.778), 32-token tiles 0.761 [1.152].
# Session 12 (h200-2026-11-30-s12/moe_t64_whole_lines.json; baseline gate-up 0.643 [0.9997, again 1.0086]): whole
# 128-byte lines of every weight row a K step (BK 256) through the pipeliner: 4 warps (wgmma, 161 regs, 3 programs
# an SM) 1.220 [1.604], capped at 128 (4 spills) 1.218 [1.608], 2 stages 1.210 [1.580]; BN 128 on 8 warps (136 regs)
# 1.445 [1.824]; BN 32 on 2 warps (mma.sync, 252 regs) 0.981 [1.346]; 64 bytes a row (BK 128, 241 regs) 0.728
# [1.088]. Their K loops issue as many instructions per weight element as the baseline's (~3.7: 956 a 256-wide step
# on 4 warps, 474 a 64-wide step on 2), so they lose on latency: 8-12 warps an SM instead of 16, and on wgmma a
# wait_group 0 after each of a step's 8 dots (the decoded operand comes from registers). The raster (both kernels):
# GROUP_M 1 (a tile's row blocks back to back) 0.649 [0.995], GROUP_M 32 0.655 [1.011]: noise.
# Session 14 (h200-2026-11-30-s14/moe_t64_tma.json; baseline gate-up 0.660 [1.0027, again 0.9963]): the packed
# weights by TMA (TMA 1, its down kernel kept: SL2 3) with the scales read in the step (SL 1) 0.641 [0.9467], at a
# 104 cap 0.632 [0.9770; as the best 0.9513, PDL off 0.9470: now DECODE_T64's], 4 stages 0.692 [0.9850], cap 104 /
# 4 stages 0.664 [0.998], 6 stages 0.750 [1.095], SL 2 (scale words by cp.async) 0.643 [1.005], BK 128 / 4 stages /
# cap 168 (156 regs) 0.741 [1.100], PF 0.791 [1.184]. With the best, the context's L2 fetch granularity at 128 bytes
# 1.0255 (slower).
UP_VARIANTS = {}
# Session 15 (h200-2026-11-30-s15/moe_t64_gluon_tiles.json, moe_t64_gluon_tuned.json; baseline gate-up 0.608 [0.939] /
# 0.616 [0.944]): the Gluon gate-up (GG 1, _moe_grouped_gluon.py; W warps x MT 16-row tiles a warp, NWT 4, 16 tokens a
# tile): DEC 0 W4 x MT1 0.632 / 0.636 [0.971 / 0.978], W2 x MT1 0.637, W4 x MT2 0.646, W8 x MT1 0.657, NWT 2 0.707,
# 8 tokens a tile 0.856; DEC 1 W4 x MT1 0.646 [0.996], at a 128 cap 0.613 [0.954] (GLUON_T64), W4 x MT2 0.617 [0.966],
# W2 x MT2 0.621, W2 x MT1 0.652; scales and words two steps ahead 0.713; cp.async rings of 3-6 stages 0.619-0.754.
# GLUON_T64 with the L2 fetch granularity at 128 bytes: whole op 0.906.
# Session 21 (h200-2026-12-01-s21/moe_t64_ggu_tiles.json; GLUON_T64 gate-up 0.548 [0.858 / 0.866]; ncu of GLUON_T64 in
# moe_t64_ncu.txt: L1/TEX 82% and L2 80% busy, DRAM 60%, 43% of stall samples on the first use of a step's loads, each
# warp loading its B columns (4 KB a step) for 2 KB of weight words): GGU with MT2 (32 rows a warp, half the column
# bytes per weight byte) at a 168 cap 0.728 [1.029], uncapped 0.580 [0.882], W2 x MT2 / 168 0.721 [1.030]; W8 x MT1
# 0.596 [0.888]. Not taken. MOE_BENCH_T64_GG=1: GLUON_T64 again, beside the
# baseline, both also at 128 bytes (with the probes on).
GG = os.environ.get("MOE_BENCH_T64_GG", "0") == "1"
if GG:
    UP_VARIANTS["gluon_t64"] = dict(mc.GLUON_T64)
# Session 23 (h200-2026-12-02-s23/moe_t64_ring.json; GLUON_T64 gate-up 0.551 [0.864 / 0.856]): the weight words
# through a TMA ring in shared memory instead of registers (commit 8566831's _moe_gate_up_ring.py, config GGT: one warp
# a program, one mbarrier a slot, the slot refilled right after its words are read, no CTA barrier in the loop; whole
# op bitwise equal to the register form on one warp, 0.568 [0.877]): 3 slots 0.729 [1.035], 4 slots 0.760 [1.081], at
# a 168 cap 0.682 [0.987], 6 slots 0.943 [1.381], 8 at a 96 cap 1.214 [1.644]. The deeper the ring the slower: the
# shared memory it takes comes out of L1, where every warp's B columns (2 bytes for each weight byte, 64% L1 hit
# rate in session 21's ncu) are served. Removed.
# Session 23, the gate-up on wgmma (commit b93b65e's _moe_gate_up_wgmma.py, config GGX; h200-2026-12-02-s23/
# moe_t64_wgmma*.json; the heuristic's gate-up 0.547-0.559 in the same calls): 64 weight rows a warpgroup, the decoded
# words as the wgmma's A in registers (`_a_mul` relabelled, no value moved; z's columns permuted to match by one gather
# a launch), the tile's activation columns as B through a cp.async ring in shared memory (no L1 traffic, no PRMT), the
# K loop at about half the register form's instructions. Words two steps ahead in registers, one step an iteration:
# 0.627-0.661 (GGR 168 / 128 / uncapped, 3-4 slots); two steps an iteration 0.621 uncapped (167 regs), 0.634 S4 / 168,
# 0.80 at a 128 cap (32 spills). Words through a TMA ring (one mbarrier a slot): S2 0.587, S3 0.585, S4 0.703, S5 0.691
# (128 regs), S4 / 168 0.715. With the next step's operands decoded while this step's chains run (two operand sets,
# wgmma_wait(2)): 250 registers (two programs an SM) S3 0.706, S4 0.826, S6 0.853; at a 168 cap ptxas serialises the
# wgmmas (136 regs) 0.850. Every form within the fp32 reference's bf16 rounding (0.00234), graph == eager, skewed
# routing and wide scales pass. A warpgroup serialises decode -> wgmma chain -> wait within a step, and the register
# form's 16 independent warps hide that better; removed.
# MOE_BENCH_T64_GDO=N: N alternated pairs of GLUON_T64 without and with GDO (the Gluon down kernel started on each
# expert as its gate-up programs finish: per-expert completion counters, the down kernel's PDL wait before its first
# store; `_moe_down_gluon._await_expert`). Session 23 (moe_t64_gdo.json, before GDO was GLUON_T64's): whole op 0.843
# with vs 0.860 / 0.863; moe_t64_gdo_pairs.json: four pairs, faster with GDO in each (medians 0.862 vs 0.888)
for _r in range(int(os.environ.get("MOE_BENCH_T64_GDO", "0"))):      # N: N alternated pairs
    UP_VARIANTS.update({f"gdo_off{_r}": {"GG": 1, "GDO": 0}, f"gdo_on{_r}": {"GG": 1, "GDO": 1}})
# down variants. Session 10 (down alone, ms): session 8's BN2 128 / cap 168 (165 regs) 0.352; BN2 64 at a 96 cap
# (the new heuristic: 10 programs an SM) 0.341; BN2 128 uncapped 0.354, cap 128 0.352, 6 stages 0.398, 4-warp
# wgmma 0.396; KU2 4 / 2 stages 0.346, KU2 2 / 3 stages 0.347. Session 12 (baseline 0.3435, its down kernel at the
# gate-up's 3 stages / cap 128: this file's base config took them until then): BK2 256 on 4 warps (wgmma, 117 regs)
# 0.601 [1.260], cap 104 / 4 stages 0.640 [1.295], cap 96 (6 spills) 0.581 [1.238]; BN2 128 x BK2 256 on 4 warps
# (173 regs) 0.591 [1.243]; BN2 32 x BK2 256 on 2 warps (168) 0.573 [1.226]; BK2 256 on 2 warps (232) 0.502 [1.160];
# BK2 128 (140) 0.369 [1.016]
# Session 14 (baseline down 0.330): the weights by TMA (SL2 1) 0.364 [0.9942], cap 80 (12 programs an SM) 0.353
# [0.9884], SL2 2 0.367 [1.003], 6 stages 0.381 [1.026], cap 80 / 6 stages 0.383 [1.045], BK2 128 / 4 stages / cap 128
# 0.374 [1.021]: slower, removed (the down kernel reads the pointer path's way)
DOWN_VARIANTS = {}
# Session 16: the Gluon down kernel (GD 1, _moe_down_gluon.py; W warps x MT 16-row tiles, NWT 4, 16 rows of h a tile),
# down alone ms [whole op]. Call 1 (h200-2026-11-30-s16/moe_t64_down_gluon_call1.json; the Triton down 0.328): words
# one step ahead: column-order h MT1 (96 regs) 0.398 [1.055]; h stored by the gate-up in the operand's order: MT2 (128)
# 0.332 [1.007], two steps an iteration MT2 0.333, W2 x MT2 0.332, MT1 0.424, MT1 at an 80 cap 0.414, W8 x MT1 0.428;
# step 0's words before the PDL wait: no change. Call 2 (moe_t64_down_gluon_call2.json; the Triton down 0.332 [0.988],
# again [0.995]): the words U steps ahead, U steps an iteration: U 2 MT2 (167 regs) 0.290 [0.965] (now GLUON_T64's),
# U 2 MT1 (127) 0.393, U 4 MT1 W4 / W2 / W8 (128) 0.399-0.406 (first words before the PDL wait 0.411), U 4 NWT 2 x MT2
# (128) 0.310; U 1 MT2 0.339. Offline sm_90 SASS a K step: column-order h 261 (MT1), operand order 198, + U 2 187.5.
# The gate-up's words two steps ahead (GGU, _moe_grouped_gluon.py; z's column pairs by one PRMT a register; offline
# 387 SASS a step vs 431), gate-up alone (GLUON_T64 of session 15: 0.641): capped at 128 (no spills) 0.573 [0.899],
# 168 (164 regs) 0.590, uncapped (167) 0.585, first words before the PDL wait 0.589. Both: whole op 0.860 (47.0% of
# read bandwidth; PDL off 0.862; at 128-byte L2 fetches 0.864, the session 15 GLUON_T64 0.912; each alone there 0.900
# (down) / 0.920 (gate-up)): now GLUON_T64.
if TINY:     # the interpreter: the pure-Triton decode, a few variants (logic only)
    UP_VARIANTS = {"up_bn32": {"BN": 32}, "up_tma": {"TMA": 1, "DEQ": "bytes16", "SL": 2, "SL2": 3}}
    DOWN_VARIANTS = {"dn_ku2": {"KU2": 2}}


def _grouped_compiled() -> dict:
    """{(kernel, key): CompiledKernel} of the grouped gate-up / down kernels compiled so far (CUDA)."""
    out = {}
    for fn in (gg._moe_gate_up_kernel, gg._moe_down_kernel, gg.gg_gluon._grouped_gate_up_kernel,
               gg.gd_gluon._grouped_down_kernel):
        try:
            for dev_cache in getattr(fn, "device_caches", {}).values():
                for key, kern in dev_cache[0].items():
                    out[fn.__name__, str(key)] = kern
        except Exception as e:      # another layout of Triton's caches: no counts, the timings stand
            DOC["notes"].append(f"t64 stats: JIT caches unreadable ({type(e).__name__}: {str(e)[:100]})")
    return out


def kernel_stats(before: dict) -> list:
    """Registers, spills, SASS instructions of the K loop (per opcode) of the grouped kernels compiled since `before`."""
    rows = []
    for (fn, key), kern in _grouped_compiled().items():
        if (fn, key) in before:
            continue
        try:
            kern._init_handles()
            ops, loop = _sass_ops(kern.asm["sass"])
            rows.append({"kernel": fn, "regs": kern.n_regs, "spills": kern.n_spills, "warps": kern.metadata.num_warps,
                         "stages": getattr(kern.metadata, "num_stages", None), "shared": kern.metadata.shared,
                         "sass": len(ops), "loop": len(loop), "loop_ops": {o: loop.count(o) for o in _SASS_OPS}})
        except Exception as e:
            rows.append({"kernel": fn, "error": f"{type(e).__name__}: {str(e)[:200]}"})
    return rows


def _parts(cfg, case, kernels):
    """Graph-replay ms of the grouped kernels named in `kernels` alone (pre-permuted routings; timing only)."""
    calls = case[0]
    segs = [mr.permute_tokens(ids, E) for _, _, ids in calls]
    fns = [lambda a=a, sg=sg: gg.expert_pair_outputs(a[0], a[2], W["w1"], W["w2"], W["w3"], "situ", B1, B2, cfg,
                                                     sg, kernels=kernels) for a, sg in zip(calls, segs)]
    return graph_ms(fns)


def run_variant(name, cfg, case, part, bitwise=False) -> dict | None:
    """The whole op (checked, graph replay; decode_variant records it) and `part` alone; -> the part's record."""
    if time.time() - REPORT.t0 > DEADLINE:
        DOC["notes"].append(f"t64 {name} skipped: time budget")
        return None
    before = _grouped_compiled() if DEV == "cuda" else {}
    res = decode_variant(T64, K64, "t64_" + name, cfg, case, bitwise=bitwise)
    if res is None or not res[1]:
        return None
    try:
        t = _parts(cfg, case, part)
    except Exception as e:
        DOC["errors"].append({"section": f"t64_{name}_part", "error": f"{type(e).__name__}: {str(e)[:300]}"})
        return None
    return record(f"t64_{name}_part_{'_'.join(part)}", t, whole_ms=round(res[0], 5), config=cfg,
                  kernels=kernel_stats(before) if DEV == "cuda" else None, timing="cuda graph, distinct routings")


# ------------------------------------------------------------------------------ read-pattern probe
@triton.jit
def _l2_line_prefetch(p):
    """Ask L2 for the 128 bytes at each pointer of p (cp.async.bulk.prefetch.L2: no result, no wait)."""
    tl.inline_asm_elementwise("cp.async.bulk.prefetch.L2.global [$1], 128;\nmov.b32 $0, 0;", "=r,l", [p],
                              dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def _pattern_kernel(w1_ptr, w3_ptr, out_ptr, n_tiles, live, stride_we, stride_wn, ROW_BYTES: tl.constexpr,
                    BN: tl.constexpr, BKB: tl.constexpr, U: tl.constexpr, PF: tl.constexpr, N_BLOCKS: tl.constexpr,
                    GROUP_M: tl.constexpr):
    """The gate-up's weight reads alone: tile t reads expert t % live's rows [nb·BN, nb·BN + BN) of w1 and w3,
    U loads of BKB bytes of each row an iteration (int32 words), XOR-folded so the loads stay live. PF: every
    128 bytes of a row, ask L2 for the row's next 128-byte line (cp.async.bulk.prefetch.L2, one per row)."""
    tid, nb = _swizzle(tl.program_id(0), n_tiles, N_BLOCKS, GROUP_M)
    base = (tid % live).to(tl.int64) * stride_we
    row = (nb * BN + tl.arange(0, BN)).to(tl.int64) * stride_wn
    rows = row[:, None] + tl.arange(0, BKB // 4)[None, :]
    acc = tl.zeros([BN, BKB // 4], dtype=tl.int32)
    for k in range(0, ROW_BYTES // 4, U * BKB // 4):
        if PF:
            if (k * 4) % 128 == 0:
                nxt = tl.minimum(k * 4 + 128, ROW_BYTES - 128) // 4
                _l2_line_prefetch(w1_ptr + base + row + nxt)
                _l2_line_prefetch(w3_ptr + base + row + nxt)
        for u in tl.static_range(U):
            kk = k + u * (BKB // 4)
            acc ^= tl.load(w1_ptr + base + rows + kk) ^ tl.load(w3_ptr + base + rows + kk)
    tl.store(out_ptr + tl.program_id(0), tl.max(tl.max(acc, 1), 0))


def pattern_probe(n_tiles, live, tag=""):
    """Bytes / time of the gate-up's weight read pattern alone: 32, 64 and 128 bytes a row a step; 32-byte pieces
    four to an iteration (issued together); 32-byte pieces with an L2 prefetch of each row's next line."""
    q1, q3 = (W[n].packed.view(torch.int32) for n in ("w1", "w3"))
    row_bytes = q1.shape[-1] * 4
    for bn, bkb, u, pf, stages in ((64, 32, 1, 0, 4), (64, 64, 1, 0, 4), (32, 64, 1, 0, 4), (64, 128, 1, 0, 3),
                                   (64, 32, 4, 0, 2), (64, 32, 1, 1, 4), (64, 32, 4, 1, 2)):
        if u * bkb > row_bytes or bn > INTER or (pf and (DEV != "cuda" or row_bytes % 128)):   # CPU dry-run shapes
            continue
        nblk = INTER // bn
        grid = n_tiles * nblk
        out = torch.empty(grid, dtype=torch.int32, device=DEV)
        try:
            fn = lambda: _pattern_kernel[(grid,)](q1, q3, out, n_tiles, live, q1.stride(0), q1.stride(1),  # noqa: E731
                                                  ROW_BYTES=row_bytes, BN=bn, BKB=bkb, U=u, PF=pf, N_BLOCKS=nblk,
                                                  GROUP_M=8, num_warps=2, num_stages=stages)
            t = graph_ms([fn] * 4) if DEV == "cuda" else graph_ms([fn])
            nbytes = 2 * grid * bn * row_bytes
            tbps = nbytes / t / 1e9
            record(f"t64_read_pattern_bn{bn}_{bkb}B_x{u}{'_l2pf' if pf else ''}{tag}", t, bytes=nbytes,
                   TBps=round(tbps, 3),
                   ratio_vs_read_bw=round(tbps / DOC["ceilings"]["read_TBps"], 3), tiles=n_tiles, live=live,
                   stages=stages)
        except Exception as e:
            DOC["errors"].append({"section": f"t64_pattern_{bn}_{bkb}_{u}_{pf}",
                                  "error": f"{type(e).__name__}: {str(e)[:300]}"})


def l2_fetch_check(cfgs: dict, case, n_tiles, live, values=(128,)):
    """The whole op (and, at 128 bytes, the read-pattern probe) with the L2 fetch-granularity hint at `values`:
    whether 32-byte row pieces fetch whole lines from HBM; the hint is restored after. H200, session 12 (default
    64 B): at 128 B the probe's 32-byte pattern 2.52 -> 3.53 TB/s (64 B 2.79 -> 4.24, 128 B 4.28 -> 4.32), the whole
    op 0.9997 / 1.0086 -> 0.9886 ms (-1.1 to -2%, about the run's spread); at 32 B 1.408 ms. So at the default the
    HBM access pattern is not what binds the two kernels."""
    if DEV != "cuda":
        return
    try:
        before = l2_fetch_granularity()
    except Exception as e:
        DOC["errors"].append({"section": "t64_l2fetch", "error": f"{type(e).__name__}: {str(e)[:300]}"})
        return
    DOC["t64_l2_fetch_default"] = before
    try:
        for v in values:
            l2_fetch_granularity(v)
            DOC.setdefault("t64_l2_fetch_set", {})[str(v)] = l2_fetch_granularity()
            for name, cfg in cfgs.items():
                decode_variant(T64, K64, f"t64_{name}_l2fetch{v}", cfg, case)
            if v == 128 and PATTERN:
                pattern_probe(n_tiles, live, tag=f"_l2fetch{v}")
            for name, cfg in cfgs.items():     # the down kernel alone at this granularity
                record(f"t64_{name}_l2fetch{v}_part_down", _parts(cfg, case, ("down",)), config=cfg)
    except Exception as e:
        DOC["errors"].append({"section": "t64_l2fetch", "error": f"{type(e).__name__}: {str(e)[:300]}"})
    finally:
        l2_fetch_granularity(before)


def wide_scales_check(case, cfg, tag):
    """Scale bytes above 128 switch the bf16 decodes to an extra multiply (WIDE): the config's decode on such
    scales vs the fp32 reference (as _moe_decode.wide_check, for any DEQ)."""
    from _moe_common import PackedMXFP4, ref_experts, rel_err, to_bf16
    z, w, ids = case[0][0]
    sc = [x.scales.clone() for x in (W["w1"], W["w2"], W["w3"])]
    for s in sc:
        s[:, ::7, ::3] += 9                               # some block scales 2^1 .. 2^3
    w1, w2, w3 = (PackedMXFP4(x.packed, s) for x, s in zip((W["w1"], W["w2"], W["w3"]), sc))
    try:
        err = rel_err(gg.moe_experts(z, w, ids, w1, w2, w3, "situ", B1, B2, cfg),
                      ref_experts(z, w, ids, *(to_bf16(x) for x in (w1, w2, w3))))
        DOC["measurements"].append({"name": f"t64_wide_scales_check_{tag}", "rel_err": err, "ok": err < 2e-2,
                                    "config": cfg})
    except Exception as e:
        DOC["errors"].append({"section": f"t64_wide_{tag}", "error": f"{type(e).__name__}: {str(e)[:300]}"})


def skew_check(case, cfg, tag):
    """Skewed routing: expert 0 in slot 0 of every token (T64 tokens: several N tiles of one expert), the rest as
    routed; the op (bf16) vs the float64 reference (ir.ref.moe in float64 on the bf16-exact weights)."""
    from ir.ref.moe import moe_experts as ref64
    z, w, ids = case[0][0]
    ids = ids.clone()
    ids[:, 0] = torch.where((ids[:, 1:] == 0).any(1), ids[:, 0], 0)      # keep each token's experts distinct
    try:
        y = gg.moe_experts(z, w, ids, W["w1"], W["w2"], W["w3"], "situ", B1, B2, cfg)
        ref = ref64(z.double(), w.double(), ids, W["w1_bf16"], W["w2_bf16"], W["w3_bf16"], "situ", B1, B2)
        err = ((y.double() - ref).norm() / ref.norm()).item() if torch.isfinite(y).all() else float("inf")
        DOC["measurements"].append({"name": f"t64_skew_check_{tag}", "rel_err_vs_f64": err, "ok": err < 2e-2,
                                    "expert0_tokens": int((ids == 0).sum()), "config": cfg})
        print(f"t64 skew check {tag}: {err}", flush=True)
    except Exception as e:
        DOC["errors"].append({"section": f"t64_skew_{tag}", "error": f"{type(e).__name__}: {str(e)[:300]}"})


def _best(names):
    by = {m["name"]: m for m in DOC["measurements"] if "median_ms" in m}
    rows = [by[n] for n in names if n in by]
    return min(rows, key=lambda m: m["median_ms"]) if rows else None


def t64_sweep():
    DOC["t64_env"] = {k: v for k, v in os.environ.items() if k.startswith("MOE_BENCH")}
    case = decode_case(T64, K64)
    key = gg._key(T64, E, K64, ELL, INTER, True, ACT, {})
    heur = gg.heuristic(gg.bucket(key), "h200" if DEV == "cuda" else None)
    base = {**heur, **{k2: heur.get(k2, heur.get(k, 0)) for k2, k in _DOWN_KEYS.items()}, "PATH": "grouped"}
    if not base.get("MAXNREG2"):
        base["MAXNREG2"] = 0
    heur_up = run_variant("heuristic", base, case, ("gate_up",), bitwise=True)
    try:
        record("t64_heuristic_part_down", _parts(base, case, ("down",)), config=base)
    except Exception as e:
        DOC["errors"].append({"section": "t64_heuristic_down", "error": f"{type(e).__name__}: {str(e)[:300]}"})
    decode_variant(T64, K64, "t64_heuristic_pdl_off", base, case, pdl=False)
    if os.environ.get("MOE_BENCH_T64_ABLATE", "0") == "1":     # the kernels with parts taken out (_moe_ablation.py)
        from _moe_ablation import t64_ablation
        t64_ablation(base, case, _parts, _grouped_compiled, kernel_stats)
    seg = mr.permute_tokens(case[0][0][2], E)
    n_tiles = int(((seg.counts + base["BM"] - 1) // base["BM"]).sum())
    live = int((seg.counts > 0).sum())
    if PROBES:
        if PATTERN:
            pattern_probe(n_tiles, live)
        l2_fetch_check({"heuristic": base, **({"gluon_t64": {**base, **mc.GLUON_T64}} if GG else {})}, case, n_tiles,
                       live)
    ups = [f"t64_{n}_part_gate_up" for n in UP_VARIANTS]
    downs = [f"t64_{n}_part_down" for n in DOWN_VARIANTS]
    for up, dn in itertools.zip_longest(UP_VARIANTS.items(), DOWN_VARIANTS.items()):    # alternately: a deadline
        if up:                                                                          # cuts both lists alike
            run_variant(up[0], {**base, **up[1]}, case, ("gate_up",), bitwise=bool(up[1].get("GG")))
        if dn:
            run_variant(dn[0], {**base, **dn[1]}, case, ("down",), bitwise=bool(dn[1].get("GD")))
    bu, bd = _best(ups + ["t64_heuristic_part_gate_up"]), _best(downs + ["t64_heuristic_part_down"])
    best = dict(base)
    for b, names in ((bu, UP_VARIANTS), (bd, DOWN_VARIANTS)):
        n = b["name"].split("_part_")[0][4:] if b else None
        best.update(names.get(n, {}))
    DOC["t64_best_config"] = best
    if best != base:
        decode_variant(T64, K64, "t64_best", best, case, bitwise=True)
        decode_variant(T64, K64, "t64_best_pdl_off", best, case, pdl=False)
        parts = {"best": best}
        if bu and bd and bu["name"] != "t64_heuristic_part_gate_up" and bd["name"] != "t64_heuristic_part_down":
            parts["best_down_only"] = {**base, **DOWN_VARIANTS[bd["name"].split("_part_")[0][4:]]}   # the two apart
            parts["best_up_only"] = {**base, **UP_VARIANTS[bu["name"].split("_part_")[0][4:]]}
        l2_fetch_check(parts, case, n_tiles, live)
    decode_variant(T64, K64, "t64_heuristic_again", base, case)     # the run's spread: the baseline timed twice
    wide_scales_check(case, best, "best")
    gluon_ups = [n for n, c in UP_VARIANTS.items() if c.get("GG")]     # Gluon gate-ups: skewed routing, wide scales
    gluon_ups += [n for n, c in DOWN_VARIANTS.items() if c.get("GD") and f"t64_{n}_part_down" in
                  {m["name"] for m in DOC["measurements"]}]     # Gluon downs that ran
    for tag, cfg in [("heuristic", base), ("best", best)] + [
            (n, {**base, **UP_VARIANTS.get(n, {}), **DOWN_VARIANTS.get(n, {})}) for n in gluon_ups]:
        if time.time() - REPORT.t0 > DEADLINE + 60:
            DOC["notes"].append(f"t64 skew / wide-scale check {tag} skipped: time budget")
            continue
        skew_check(case, cfg, tag)
        if tag in gluon_ups:
            wide_scales_check(case, cfg, tag)
    if best.get("DEQ") != "asm16i" and DEV == "cuda":
        wide_scales_check(case, {**best, "DEQ": "asm16i"}, "asm16i")
    if heur_up is None:
        DOC["notes"].append("t64: the heuristic's whole-op check failed or was skipped")
    DOC["t64_summary"] = {m["name"]: m.get("median_ms", m.get("rel_err")) for m in DOC["measurements"]
                          if m["name"].startswith(("t64_", f"decode_T{T64}_k{K64}_t64"))}
