"""Issue 5's decode target, T=64 tokens top-16 of 112 experts (MXFP4, l=3584, I=3072): the `t64` section of
bench_moe.py. The grouped path's gate-up and down kernels are swept apart (each variant changes one kernel's
tiles, warps, stages or register cap; the other keeps the heuristic's), every variant checked as the whole op
against the fp32 reference, then timed under CUDA-graph replay as the whole op and as its own kernel alone;
per compiled kernel: registers, spills and the SASS of its K loop (instructions per opcode). Then the best
gate-up with the best down as the whole op (PDL on, graph replay checked bitwise against eager, PDL off), and
a read-pattern probe: the gate-up's weight reads alone (BN rows x BK/2 bytes a K step of w1 and w3, the same
grid and raster, plain 16-byte loads, no decode; also 32-byte pieces four to an iteration, and with an L2
prefetch of each row's next line), which separates the memory system's ceiling for that access pattern from
the kernel's instruction stream.

    MOE_BENCH_SECTIONS=t64 MOE_BENCH_DECODE_DEADLINE=140 python benches/bench_moe.py   # ~40-60 s on the H200
    MOE_BENCH_T64_DEADLINE=120: seconds into the run after which no further variant is started
"""

from __future__ import annotations

import os
import time

import torch
from _moe_common import ACT, B1, B2, DEV, DOC, E, ELL, INTER, REPORT, TINY, W, gg, graph_ms, mr, record, tl, triton
from _moe_decode import _SASS_OPS, _sass_ops, decode_case, decode_variant

from codegen.triton._moe_tiles import _swizzle

T64, K64 = (8, 2) if TINY else (64, 16)
DEADLINE = float(os.environ.get("MOE_BENCH_T64_DEADLINE", 120))
# the down kernel's own keys, so a gate-up variant's num_warps / num_stages / MAXNREG leave it as the heuristic's
_DOWN_KEYS = {"num_warps2": "num_warps", "num_stages2": "num_stages", "MAXNREG2": "MAXNREG"}

# gate-up variants (overrides of the heuristic's config, _moe_configs.DECODE_T64). Session 10's sweep (H200, one run,
# gate-up alone under graph replay, ms; whole op in brackets), relative to session 8's SL 3 / BK 64 / 4 stages /
# cap 168 (155 regs): 0.691 [1.055]; cap 128 with 3 stages (the new heuristic) 0.684 [1.027]; cap 128 / 4 stages
# 0.704, uncapped (ptxas takes 128) 0.703, cap 144 0.700, cap 112 0.713 (spills), cap 128 / 6 stages 0.808, SL 1
# 0.777, BN 32 x BK 128 0.785, 4-warp wgmma BN 64 x BK 128 0.897 / BN 128 0.888. Not yet timed: KU steps an
# iteration (AOT sm_90, Triton 3.7: KU 4 with 2 stages 128 regs + 32 B of stack, 24.8 KB of shared memory) and
# DEQ asm16i (ALU-pipe instructions per K step 272 -> 214: SHF 92 -> 33, IMAD 27 -> 86; 126 regs)
UP_VARIANTS = {
    "up_s8": {"MAXNREG": 168, "num_stages": 4},
    "up_asm16i": {"DEQ": "asm16i"},     # the decode's left shifts as IMADs (both kernels; ptxas already does so in down)
    "up_ku2": {"KU": 2},
    "up_ku4_s2": {"KU": 4, "num_stages": 2},
    "up_ku4_s2_nocap": {"KU": 4, "num_stages": 2, "MAXNREG": 0},
    "up_asm16i_ku4_s2": {"DEQ": "asm16i", "KU": 4, "num_stages": 2},
    # 32-token tiles (both kernels): ~17% fewer tiles than 16-token ones (an expert with 17-32 pairs decodes and
    # reads its weights once, not twice), 214 / 152 registers (4 / 6 programs an SM; session 8, 4 stages: 1.157)
    "up_bm32": {"BM": 32, "MAXNREG": 0, "MAXNREG2": 0},
}
# down variants. Session 10 (down alone, ms): session 8's BN2 128 / cap 168 (165 regs) 0.352; BN2 64 at a 96 cap
# (the new heuristic: 10 programs an SM) 0.341; BN2 128 uncapped 0.354, cap 128 0.352, 6 stages 0.398, 4-warp
# wgmma 0.396
DOWN_VARIANTS = {
    "dn_s8": {"BN2": 128, "MAXNREG2": 168},
    "dn_ku4_s2": {"KU2": 4, "num_stages2": 2},
    "dn_ku2_s3": {"KU2": 2, "num_stages2": 3},
}
if TINY:     # the interpreter: the pure-Triton decode, a few variants (logic only)
    UP_VARIANTS = {"up_bn32": {"BN": 32}, "up_ku2": {"KU": 2}}
    DOWN_VARIANTS = {"dn_ku2": {"KU2": 2}}


def _grouped_compiled() -> dict:
    """{(kernel, key): CompiledKernel} of the grouped gate-up / down kernels compiled so far (CUDA)."""
    out = {}
    for fn in (gg._moe_gate_up_kernel, gg._moe_down_kernel):
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


def pattern_probe(n_tiles, live):
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
            record(f"t64_read_pattern_bn{bn}_{bkb}B_x{u}{'_l2pf' if pf else ''}", t, bytes=nbytes, TBps=round(tbps, 3),
                   ratio_vs_read_bw=round(tbps / DOC["ceilings"]["read_TBps"], 3), tiles=n_tiles, live=live,
                   stages=stages)
        except Exception as e:
            DOC["errors"].append({"section": f"t64_pattern_{bn}_{bkb}_{u}_{pf}",
                                  "error": f"{type(e).__name__}: {str(e)[:300]}"})


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


def _best(names):
    by = {m["name"]: m for m in DOC["measurements"] if "median_ms" in m}
    rows = [by[n] for n in names if n in by]
    return min(rows, key=lambda m: m["median_ms"]) if rows else None


def t64_sweep():
    case = decode_case(T64, K64)
    key = gg._key(T64, E, K64, ELL, INTER, True, ACT, {})
    heur = gg.heuristic(gg.bucket(key), "h200" if DEV == "cuda" else None)
    base = {**heur, **{k2: heur.get(k, 0) for k2, k in _DOWN_KEYS.items()}, "PATH": "grouped"}
    if not base.get("MAXNREG2"):
        base["MAXNREG2"] = 0
    heur_up = run_variant("heuristic", base, case, ("gate_up",), bitwise=True)
    try:
        record("t64_heuristic_part_down", _parts(base, case, ("down",)), config=base)
    except Exception as e:
        DOC["errors"].append({"section": "t64_heuristic_down", "error": f"{type(e).__name__}: {str(e)[:300]}"})
    decode_variant(T64, K64, "t64_heuristic_pdl_off", base, case, pdl=False)
    seg = mr.permute_tokens(case[0][0][2], E)
    n_tiles = int(((seg.counts + base["BM"] - 1) // base["BM"]).sum())
    pattern_probe(n_tiles, int((seg.counts > 0).sum()))
    ups = [f"t64_{n}_part_gate_up" for n in UP_VARIANTS]
    downs = [f"t64_{n}_part_down" for n in DOWN_VARIANTS]
    for name, over in UP_VARIANTS.items():
        run_variant(name, {**base, **over}, case, ("gate_up",))
    for name, over in DOWN_VARIANTS.items():
        run_variant(name, {**base, **over}, case, ("down",))
    bu, bd = _best(ups + ["t64_heuristic_part_gate_up"]), _best(downs + ["t64_heuristic_part_down"])
    best = dict(base)
    for b, names in ((bu, UP_VARIANTS), (bd, DOWN_VARIANTS)):
        n = b["name"].split("_part_")[0][4:] if b else None
        best.update(names.get(n, {}))
    DOC["t64_best_config"] = best
    if best != base:
        decode_variant(T64, K64, "t64_best", best, case, bitwise=True)
        decode_variant(T64, K64, "t64_best_pdl_off", best, case, pdl=False)
    wide_scales_check(case, best, "best")
    if best.get("DEQ") != "asm16i" and DEV == "cuda":
        wide_scales_check(case, {**best, "DEQ": "asm16i"}, "asm16i")
    if heur_up is None:
        DOC["notes"].append("t64: the heuristic's whole-op check failed or was skipped")
    DOC["t64_summary"] = {m["name"]: m.get("median_ms", m.get("rel_err")) for m in DOC["measurements"]
                          if m["name"].startswith(("t64_", f"decode_T{T64}_k{K64}_t64"))}
