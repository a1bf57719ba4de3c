"""Sparse (and dense) MLA decode in absorbed form over a latent cache pool (IR op `mla_attention`, SPEC §4).

Math, per token t (request r, position p) and head h, over its context rows c(s) = [c_KV(s); k_pe(s)]
(the selected positions Sel(t), or every s <= p without a selection):
    q~ = [W_UK^h^T q_nope ; q_pe]                          (`_absorb_kernel`, one launch, before: _mla_combine.py)
    z(s) = scale * q~ . c(s),   lse = log sum_s e^z(s),   o~ = sum_s e^(z(s)-lse) c_KV(s)
    o^h = W_UV^h o~                                         (batched matmul after; form="latent" stops at o~)
The kernel does the attention over latent rows: one program per (token, block of BLOCK_H heads,
chunk of CHUNK context entries), all heads of the block sharing every latent row it loads (the
row is read once per token, not once per head), online softmax in fp32 (exp2), tensor-core dots.
Four orientations (ORIENT): 1 = `_mla_heads_kernel` in _mla_heads.py (heads are the dots' M, one pass per step over
whole rows: FP8 pools at small batches), 2 = `_mla_rowsm_kernel` in _mla_rowsm.py (rows are the dots' M, wgmma on sm_90,
fp8 logits dots against queries split into two e4m3 parts: FP8 pools of a dense context once the tokens fill the GPU),
3 = `_mla_gluon_kernel` in _mla_gluon.py (ORIENT 2's math in Gluon, asynchronous wgmmas and cp.async row gathers: FP8
pools read through a selection once the tokens fill the GPU, on CUDA sm_90; elsewhere the launcher runs ORIENT 2 with
the same split), 0 = `_mla_sparse_kernel` in _mla_rows.py (rows are M, optional column blocks: the previous path, kept
for bf16 / NVFP4 pools). ORIENT 0-2 gather and dequantise rows through _mla_tiles.py. Chunks of the same token are
merged by `_combine_kernel` (_mla_tiles.py, launched by _mla_combine.py's `combine_chunks`, which also holds the query
absorption) with their log-sum-exps, in a fixed order (o~ i = sum_i e^(lse_i - lse) o~_i, lse = log sum_i e^lse_i). The
number of chunks is L / CHUNK with L the number of selected rows (sparse) or the context bound (dense): never the
context for a selection. Chunk boundaries depend only on CHUNK and the token's own rows; CHUNK follows the batch size
(to fill the GPU) except in batch-invariant mode, where it depends on L only.

Latent pool formats (byte layouts and dequantisation: _mla_tiles.py): "bf16" / "fp32" (rows [kv + dr] as
stored), "fp8" (e4m3 rows, one fp32 scale per layer), "nvfp4" (uint8 rows [kv/2 + kv/16 + dr]: E2M1 c_KV
with E4M3 block scales and a per-tensor scale, k_pe in e4m3 with its own scale; SPEC §7).
A pool is flat [N, width] or a block view [NB, block_size, width] whose block stride may exceed
block_size * width (a page of a packed block pool): rows are addressed through `_paging.row_offsets` with
the view's strides (`pool_strides`), never copied. FP8 pools are read through an fp8 pointer on the GPU.
`mla_prefill.quantize_latent_fp8` / `quantize_latent_nvfp4` write those pools, `dequantize_latent` reads
them back (in torch; prefill decompresses from it).

Selections are positions (the IR op; mapped to rows by the block table, `_paging`) or physical rows
(`selection_rows=True`, what `indexer_topk(..., output="rows")` returns); -1 entries are skipped.
Tunables: ORIENT, BLOCK_H, BLOCK_N (rows per step), CHUNK (rows per program), SUB (ORIENT 0: column
blocks per row, 1 = one pass, 4 = two passes), PREFETCH (1: next step's rows resolved a step ahead; ORIENT 1 also
2: next step's bytes in registers), LSUM (ORIENT 1: softmax denominators summed over the row lanes once after the
loop: one cross-warp reduction per step instead of two),
F16 (ORIENT 1 on FP8 / NVFP4 pools: fp16 dots with per-head power-of-two query scaling, `_mla_heads.py`),
KB (ORIENT 2: width of the c_KV column blocks), num_warps (ORIENT 3: 4), num_stages (ORIENT 3:
row buffers). Not searched: FOLD (ORIENT 3 with 2 to FOLD_PIECES pieces a token: the last piece of a token's head
block to arrive merges them, `_mla_gluon._merge_pieces`, the combine's formula, no combine launch; always faster where
measured, so on unless a config says FOLD 0).
"""

from __future__ import annotations

import math

import torch
import triton.language as tl

from ..kernel import KernelTemplate, Tunable, pow2_bucket
from ._mla_combine import _interpreting, absorb_queries, combine_chunks, split_kv_b
from ._mla_heads import _mla_heads_kernel
from ._mla_rows import _mla_sparse_kernel
from ._mla_rowsm import _mla_rowsm_kernel
from ._mla_tiles import _LN2, e2m1_to_f32, e8m0_to_f32  # noqa: F401  (re-exported: mla_prefill, the indexer)
from ._gemv import tile_counters
from ._paging import context_bound, paging_args, pool_strides
from ._pdl import launch_kwargs
from codegen.triton import _precision as precision

LOG2E = 1.4426950408889634
LATENT_FORMATS = ("bf16", "fp32", "fp8", "nvfp4")


# ------------------------------------------------------------------------------------ host API
PARTIAL_BYTES = 1 << 30  # split partials held at once (see sparse_latent_attention)
FOLD_PIECES = 4          # FOLD's merge reads every piece's partial in one program: a few pieces only (measured at 2
#                          and 4; batch 1, 32 pieces: 42.3 us vs the combine launch's 10.1, batch 8, 16 pieces:
#                          21.9-23.8 vs 16.6, H200 s22)


def _pow2(n: int) -> int:
    return 1 << max(0, math.ceil(math.log2(max(1, n))))


def heuristic(key: dict, target: str) -> dict:
    """FP8 pools (the model's) read through a selection: ORIENT 3 (`_mla_gluon_kernel`: BLOCK_N 64 rows as the wgmma M,
    4 warps) at every batch (not batch-invariant mode), CHUNK sized for about one program an SM (128 of 132) and at
    least one step of 64 rows, up to 1024 (the row table): batch 1 CHUNK 64, 8 128, 32 512, 64 1024; 3 row buffers
    where one program an SM runs >= 4 steps, else 2; a token's 2-4 pieces are merged in the launch (FOLD, below),
    more by the combine launch. Off sm_90 the launcher runs that split with ORIENT 2 (tokens x head blocks >= 32) or ORIENT 1.
    A dense context (no selection): ORIENT 2 (`_mla_rowsm_kernel`) once the tokens fill the GPU (T x head blocks >=
    32), else ORIENT 1 (`_mla_heads_kernel`), as batch-invariant mode; BLOCK_H 16 heads per program (ORIENT 1: the
    MMA's minimum M; the fp32 accumulator is BLOCK_H x kv), rows resolved a step ahead (PREFETCH 1: positions are two
    dependent reads, index then block id, before the gather). There CHUNK (rows per program) sizes the split of a
    token's rows, which is what fills the GPU at small batches: a batch of T tokens gets about 4 programs per SM
    (132 SMs) in all, pieces of >= BLOCK_N rows. Under batch-invariant mode (key bi 1) the chunk depends on L only
    (16 pieces).
    H200 session 21 (benches/results/h200-2026-12-01-s21, bench_mla_b64.py with 4 input sets in one graph at batch
    64 / 32 and 16 at 8 / 1; every config checked against float64, graph == eager, -1 entries, short contexts, an
    empty token, positions; ncu profiles in mla_b64_ncu*): the Gluon kernel's row table read in one load instead of
    one a step (its prologue was ~23% of the kernel's stall samples) and its partials stored 16 bytes a thread (the
    epilogue ~8.5%): kernel 36.35 -> 32.86 us at batch 64 (ncu). Batch 64: CHUNK 1024 / 3 stages / FOLD 38.06 us
    (48.1% of read bandwidth) vs 40.50 without FOLD (the previous rule), CHUNK 512 / 2 stages / FOLD 39.69, CHUNK 512
    / 2 stages 45.66; batch 32: CHUNK 512 / 3 / FOLD 26.42 vs the previous CHUNK 256 / 2 29.30; batch 8: ORIENT 3
    CHUNK 128 / 2 stages 16.68 vs ORIENT 1 (the previous rule) 24.19, CHUNK 64 18.78; batch 1: CHUNK 64 10.25 vs
    ORIENT 1 11.65 (10.14 / 11.63, 9.94 / 11.36 in two more calls), CHUNK 128 11.41.
    H200 2026-11-29 (benches/bench_attention_decode.py; FP8 latents, 12 heads, top-2048 rows of 8K contexts,
    whole launcher under graph replay, inputs rotated so rows come from HBM):
      batch 1:  BLOCK_N 64, 8 warps, num_stages 2, CHUNK 64 (32 pieces): 16.8 us; 32-row pieces 17.6-17.9;
                128-row pieces 24-26; the previous path (einsum, rows-major kernel in 4 pieces, fp32 out + cast)
                76.8 us; the rank record's CHUNK 4096 (one program per token) 424.5 us.
      batch 64: BLOCK_N 32, 4 warps, num_stages 1, CHUNK 256 (8 pieces): 98.9 us (18.3% of read bandwidth);
                the previous path 110.5 us; PREFETCH 2 (next step's bytes in registers) 102-117 us.
    Session 6 (same bench): batch 1 14.9 us (BLOCK_N 32 / 4 warps / CHUNK 32: 14.6, noise); batch 64 108.3 us,
    CHUNK 512 109.8, BLOCK_N 16 141-153. ptxas (sm_90a): every ORIENT 1 config sits at 255 registers (heads as
    the mma.sync M replicate the 576-wide query operand in every warp), so 2 programs of 4 warps per SM and
    one step's rows in flight each: the batch-64 gap to bandwidth. A column-blocked variant that re-read query
    blocks per step (fewer live registers in theory) measured 158-240 us at batch 64 and was dropped.
    Session 7 (same bench, PDL on): batch 1 12.1 us with BLOCK_N 32 / 4 warps / CHUNK 32 (the batch-64 rule's config)
    vs 12.5 for BLOCK_N 64 / 8 warps / CHUNK 64 (the same order as session 6's 14.6 / 14.9: one rule for every
    batch now); PDL off 15.0 us. Batch 64: 104.1 us (17.1%); CHUNK 512 103.7, num_stages 2 110.5, BLOCK_N 64 / 8
    warps 131-139, PREFETCH 0 114.3: the 255-register bound stands (see above). ptxas (Triton 3.6 for sm_90a,
    compiled without a GPU: triton.compile for GPUTarget("cuda", 90, 32) with the 16-byte divisibility hints real
    launches get, cuobjdump -res-usage): 255 registers and no stack at the default, 8 B of stack at PREFETCH 0,
    239 registers at 8 warps (BLOCK_N 32: not timed at batch 64 yet, the bench sweeps it), 255 + 72 B stack at
    BLOCK_N 64 / 8 warps. The replicated [BLOCK_H, kv] bf16 query operand (128 registers per thread) and the
    [BLOCK_H, kv] fp32 accumulator (64 at 4 warps) leave little for a step's rows in flight.
    Session 8 (same bench, 4.40 TB/s streaming read; benches/bench_attention_decode.py, one call): batch 64 100.6 us
    (CHUNK 256) / 99.2 (CHUNK 512) = 18.1%; the kernel + combine without the query absorption 97.8. Measured slower
    and dropped: L2 bulk prefetch of later steps' rows (cp.async.bulk.prefetch.L2, 1 / 2 steps ahead or the whole
    chunk up front: 111-123 us), register caps for 3-4 programs per SM (maxnreg 168 / 128: 145-169 us, spills),
    8 warps 182, PREFETCH 2 142, the rows-major kernel with prefetch 123-194. So the bound is not bytes in flight
    but instructions: the loop issues 1611 SASS instructions per thread per 32-row step (Triton 3.7 build), a third
    of them e4m3 -> bf16 conversions (through fp16 and fp32) and byte-wise shared-memory loads (the compiler moves
    the 8-bit tile's transpose for q~ c^T before the widening), with 8 warps per SM to hide latency. F16 1 (opt-in:
    fp16 dots, per-head power-of-two query scaling, rows widened by one cvt per pair before any re-layout) issues
    701; batch 1: 12.0 us (PDL off 14.4). The lead's call (same bench): F16 at batch 64 76.4 us with CHUNK 512
    and num_stages 3 (~23.5% of read bandwidth; the F16-off default 104.6), CHUNK 512 / stages 1 81.0, CHUNK
    256 / stages 1 84.7, stages 2 84.5-88.8, 8 warps 95.6, CHUNK 128 95.0; batch 1 11.46 (F16-off 11.90);
    both checked against float64 and graph replay == eager over 50 replays: F16 is the FP8 default, with 2
    programs per SM and 3 stages once the tokens alone fill the GPU.
    Session 10 (same bench, one call; benches/bench_attention_decode.py, 4.31 TB/s streaming read): batch 64 default
    75.2 us (24.5%; PDL off 77.7), LSUM 1 74.2 (24.8%, PDL off 78.8: now the default when the tokens fill the GPU),
    LSUM + num_stages 4 (gathers two steps ahead, 110.6 KB shared) 74.9, num_stages 4 alone 80.4, LSUM + stages 2
    83.0, CHUNK 256 81.3, BLOCK_N 16 / 6 stages 102.6; measured no better and removed: the piece's selection
    prefetched into L1 (76.5 / 74.7 with LSUM + 4 stages), rescaling skipped where no maximum moved (75.6), the
    query operand re-laid out from shared memory each step under a 168-register cap for 3 programs per SM
    (83.0-84.0 at 6 pieces of 352 rows, 106.3 at CHUNK 512). Where the time goes: every token reading token 0's
    rows (1.2 MB, L2 resident) takes 71.5-71.7 us and contiguous 64-row blocks 76.0-77.7: the kernel is bound
    inside the SM (2 programs x 4 warps per SM, 252 registers, a ~4.4 us chain per 32-row step: ~670 SASS
    instructions per thread, 7-10 barriers, 74 e4m3 -> f16 conversions), not by HBM bandwidth or DRAM locality;
    the query absorption costs ~2 us (72.1 without it). Batch 1: 11.15 us (PDL off 13.64), LSUM 11.21 (kept off there).
    Session 11 (one call): batch 1 11.62 us; the pieces merging their own partials in launch (COMBINE: every piece
    arrives at a counter, spins until all have, then merges a column slice; no `_combine_kernel` launch; exact,
    graph == eager) measured 12.87 us at 64 pieces, 14.99 at 32, 15.92 at 128, and 28.4 vs 25.4 us in the indexer +
    MLA chain. Not kept. Batch 64 77.7 us this run (23.4% of 4.36 TB/s; L2-resident rows 71.3, contiguous 75.5).
    Session 13 (benches/bench_mla_b64.py, one call, 4.37 TB/s streaming read; every config checked against float64
    and graph replay == eager): batch 64 ORIENT 1 (this heuristic's session-10 config) 76.96 us (23.6%; L2-resident
    rows 71.3), ORIENT 2 67.49 (26.9%; L2-resident rows 62.3): now the default there; its other configs and removed
    variants are in _mla_rowsm.py's docstring. Batch 1: ORIENT 1 11.61 us, ORIENT 2 (CHUNK 64, 2 stages) 11.60:
    ORIENT 1 kept. Batch 32 (also "many") was not measured with ORIENT 2. In the rank decode graph at batch 64 (8K,
    benches/results/h200-2026-11-30-s13/runtime_mla_orient.json, two rounds) the step took 2433.7 / 2456.8 us with
    ORIENT 2 vs 2458.1 / 2440.5 with the ORIENT 1 config (the node is ~10 us of a 2.4 ms step: within the noise).
    Numerics: o~ vs float64 2.42e-3 (ORIENT 1: 2.25e-3), lse 1.52e-5 (1.23e-5): the fp8 logits' tensor-core sums.
    Session 15 (benches/bench_mla_b64.py, two calls: benches/results/h200-2026-11-30-s15/mla_b64_gluon_call{1,2}.json,
    4.36-4.42 TB/s streaming read, every config checked against float64 incl. -1 entries, short contexts, an empty token
    and positions through the block table, graph replay == eager over 50 replays): batch 64 ORIENT 3 (Gluon, then the
    default: CHUNK 1024, 2 stages, XF2) 57.54 us (31.6% of read bandwidth) against ORIENT 2's 67.97 in the same call
    (0.85x; 3 stages and one widened buffer 57.82); o~ vs float64 2.56e-3, lse 1.63e-5 (ORIENT 2: 2.43e-3, 1.52e-5).
    Its other configs and the removed variants are in _mla_gluon.py's docstring. Batch 1 (same call): ORIENT 1 11.57
    us, ORIENT 3 CHUNK 64 / 2 stages 11.16 with 4 warps, 10.87 with 8 (a lead from one measurement; ORIENT 1 kept).
    Session 15 round 2 (same bench, calls benches/results/h200-2026-11-30-s15/mla_b64_gluon_r2_call{1,2}.json, same
    checks, all passed): ORIENT 3 with the query's two e4m3 parts as one N = 32 dot and the value dot's A in registers
    (_mla_gluon.py) at batch 64, CHUNK 1024, 3 stages: 49.66 us (36.6% of read bandwidth; L2-resident rows, 4 stages:
    43.65) against round 1's default (CHUNK 1024, 2 stages, widened rows in shared memory) 57.66 and ORIENT 2 67.81 in
    the same call (0.86x / 0.73x); 4 stages 50.91, 5 stages 53.34, CHUNK 512 / 2 stages (two programs per SM) 54.88.
    Batch 32: CHUNK 256 / 2 stages (two per SM) 34.56 us against CHUNK 512 / 4 stages 37.12 and round 1's form at its
    rule's CHUNK 512 38.78 (CHUNK 512 / 3 stages, this rule's one-per-SM branch, not measured). o~ vs float64 2.27e-3,
    lse 1.4e-5. Batch 1 (call 2): ORIENT 1 11.31 us; ORIENT 3 CHUNK 64 / 2 stages in round 1's form 10.88, with the
    one-dot query 10.12 (values still widened in shared memory, a form since removed); call 1's register value dot in
    one block (removed) 14.08: a lead for small batches, the kept form not measured there (ORIENT 1 kept).
    bf16 and NVFP4 pools keep the rows-major kernel's configs (measured 2026-11-29 s3: 0.087 / 0.185 ms at
    batch 64), with the same split rule."""
    H = max(1, key.get("H", 16))
    bh = 16 if target != "cpu" or H <= 16 else min(32, _pow2(H))
    L = max(1, key["L"])
    if target == "cpu":
        return dict(ORIENT=1, BLOCK_H=bh, BLOCK_N=32, CHUNK=max(32, _pow2(L)), num_warps=4, num_stages=1, PREFETCH=1)
    T = key.get("T", 0)
    fmt = key.get("fmt", 1)
    many = not key.get("bi", 0) and T * -(-H // bh) >= 32  # tokens alone fill the GPU (batch 64: 64 programs)
    if key.get("bi", 0) or not T:
        pieces = 16
    else:
        pieces = max(1, ((2 if many and fmt == 1 else 4) * 132) // (T * -(-H // bh)))
    if fmt != 1:   # bf16 / NVFP4 pools: the previous rows-major configs (ORIENT 1 not yet measured on them)
        cfg = dict(ORIENT=0, BLOCK_H=bh, BLOCK_N=32, num_warps=4, num_stages=2, SUB=1, PREFETCH=1) if fmt == 0 else \
            dict(ORIENT=0, BLOCK_H=bh, BLOCK_N=64, num_warps=4, num_stages=1, SUB=4, PREFETCH=1)
    elif key.get("sparse", 1) and T and not key.get("bi", 0):   # rows as the wgmma M, fp8 logits, in Gluon
        blocks = T * -(-H // bh)
        chunk = min(1024, max(64, _pow2(-(-L * blocks // 128))))   # about one program an SM (128 of 132)
        n = -(-L // chunk)
        return dict(ORIENT=3, BLOCK_H=bh, BLOCK_N=64, num_warps=4, PREFETCH=1, CHUNK=chunk,
                    num_stages=3 if blocks * n <= 132 and chunk >= 256 else 2)
    elif many:   # a dense context: rows as the dots' M (wgmma), fp8 logits (_mla_rowsm.py)
        cfg = dict(ORIENT=2, BLOCK_H=bh, BLOCK_N=64, KB=128, num_warps=4, num_stages=3, PREFETCH=1)
    else:
        cfg = dict(ORIENT=1, BLOCK_H=bh, BLOCK_N=32, num_warps=4, num_stages=1, PREFETCH=1, F16=1)
    cfg["CHUNK"] = min(16384, max(cfg["BLOCK_N"], _pow2(-(-L // pieces))))
    return cfg


def sparse_latent_attention(q_abs, q_pe, latent, token_pos, paging, scale: float, selection=None, *,
                            latent_format: str = "bf16", latent_scale: float = 1.0, pe_scale: float = 1.0,
                            config: dict | None = None, max_context: int | None = None,
                            block_size: int | None = None, out_dtype: torch.dtype = torch.float32):
    """(o~ [T, H, kv] in out_dtype, lse fp32 [T, H]) of softmax(scale * q~ . c) over each token's rows.
    q_abs [T, H, kv], q_pe [T, H, dr]; `paging` = `_paging.paging_args(block_table, token_req,
    block_size)` maps request positions (selection entries, or 0 .. token_pos without a selection) to
    pool rows; paging None means the selection already holds pool rows. The pool is flat [N, width] or a
    block view [NB, block_size, width] with any block stride (a page of a packed block pool), read in
    place through `_paging.pool_strides`; `block_size` is needed only for a block view read by rows.
    Nothing is read on the host when a selection is given or `max_context` is (CUDA-graph safe).
    Launches: the attention kernel, plus `_combine_kernel` when a token's rows are split (CHUNK < L)."""
    if latent_format not in LATENT_FORMATS:
        raise ValueError(f"latent_format must be one of {LATENT_FORMATS}, found {latent_format!r}")
    T, H, KV = q_abs.shape
    DR = q_pe.shape[2]
    fmt = {"bf16": 0, "fp32": 0, "fp8": 1, "nvfp4": 2}[latent_format]
    width = KV + DR if fmt < 2 else KV // 2 + KV // 16 + DR
    if latent.dim() not in (2, 3) or latent.shape[-1] != width:
        raise ValueError(f"mla: {latent_format} latent pool {tuple(latent.shape)} must be [N, {width}] or a block "
                         f"view [NB, block_size, {width}] for kv={KV}, dr={DR}")
    if KV & (KV - 1) or DR & (DR - 1) or KV < 32 or DR < 16:
        raise ValueError(f"mla: kv {KV} and dr {DR} must be powers of two (kv >= 32, dr >= 16)")
    dev = q_abs.device
    pos = token_pos.to(dev).contiguous()   # int32 or int64: the kernels read either
    if selection is not None:
        sel = selection.to(dev).contiguous()
        L = sel.shape[1]
    else:
        sel = pos  # unused
        L = int(max_context) if max_context is not None else (int(pos.max()) + 1 if T else 1)
    key = {"H": H, "L": L, "fmt": fmt, "T": T, "sparse": int(selection is not None)}
    cfg = dict(config or heuristic(key, "cpu" if dev.type == "cpu" else "gpu"))
    orient = int(cfg.get("ORIENT", 0))
    bh, bn, chunk = int(cfg["BLOCK_H"]), int(cfg["BLOCK_N"]), int(cfg["CHUNK"])
    prefetch = int(cfg.get("PREFETCH", 0))
    lsum = int(cfg.get("LSUM", 0))
    kb = min(KV, int(cfg.get("KB", 128)))
    if orient == 3:   # Gluon (CUDA sm_90, FP8 pool, a selection); elsewhere, with the same split, ORIENT 2 (session
        # 13's config; CHUNK unchanged: ORIENT 2 at CHUNK 1024 is not measured) once the tokens fill the GPU, else
        # ORIENT 1 (the rule before session 21)
        from . import _mla_gluon
        if not _mla_gluon.usable(q_abs, latent, selection, fmt, bh, chunk):
            if T * -(-H // bh) >= 32:
                orient, bn = 2, 64
                cfg.update(ORIENT=2, BLOCK_N=64, KB=128, num_warps=4, num_stages=3, PREFETCH=1, FOLD=0)
            else:
                orient, bn = 1, 32
                cfg.update(ORIENT=1, BLOCK_N=32, num_warps=4, num_stages=1, PREFETCH=1, F16=1, FOLD=0)
            prefetch = 1
    if prefetch not in (0, 1, 2) or orient not in (0, 1, 2, 3) or (orient != 0 and int(cfg.get("SUB", 1)) != 1) or \
            (orient != 1 and (prefetch == 2 or lsum)) or lsum not in (0, 1) or \
            (orient == 2 and (fmt != 1 or KV % kb or kb & (kb - 1) or kb < 16)):
        raise ValueError(f"mla: config {cfg}: ORIENT must be 0, 1, 2 or 3 (2: FP8 pools only, KB a power of two "
                         f"dividing kv), PREFETCH 0 or 1 (ORIENT 1 also 2), LSUM 0 or 1 (ORIENT 1's), and ORIENT 1 / 2 "
                         f"take whole rows (SUB 1)")
    fold_cfg = cfg.get("FOLD")   # None: on where it applies
    nsplit = max(1, -(-L // chunk))
    if fold_cfg not in (None, 0, 1) or (fold_cfg == 1 and (orient != 3 or nsplit > FOLD_PIECES)):
        raise ValueError(f"mla: config {cfg}: FOLD 1 (pieces merged in the attention launch) is ORIENT 3's, for at "
                         f"most {FOLD_PIECES} pieces (L {L} / CHUNK {chunk}: {nsplit}); FOLD 0 keeps the combine "
                         f"launch")
    fold_cfg = orient == 3 and 1 < nsplit <= FOLD_PIECES and fold_cfg != 0
    o = torch.empty(T, H, KV, dtype=out_dtype, device=dev)
    lse = torch.empty(T, H, dtype=torch.float32, device=dev)
    if T == 0:
        return o, lse
    # split partials for at most PARTIAL_BYTES at a time: a long prefill runs in token slices (each token is
    # computed alone, so slicing changes no result; a 128K-token step would otherwise hold T*H*nsplit*kv)
    tb = T if nsplit == 1 else max(1, min(T, PARTIAL_BYTES // (H * nsplit * (KV + 1) * 4)))
    if nsplit > 1:
        po_all = torch.empty(tb, H, nsplit, KV, dtype=torch.float32, device=dev)
        plse_all = torch.empty(tb, H, nsplit, dtype=torch.float32, device=dev)
    # FP8 pools through an fp8 pointer on the GPU (16-byte async copies the pipeliner can stream)
    lat = latent.view(torch.uint8 if fmt == 2 or _interpreting() else torch.float8_e4m3fn) if fmt > 0 else latent
    f32 = _interpreting() or (fmt == 0 and latent.dtype == torch.float32)
    vs = 1.0 if fmt == 0 else float(latent_scale)                     # scale of c_KV values
    ps = {0: 1.0, 1: float(latent_scale), 2: float(pe_scale)}[fmt]       # scale of k_pe values
    f16 = int(cfg.get("F16", 0))
    if f16 not in (0, 1) or (f16 and (orient != 1 or fmt == 0)):
        raise ValueError(f"mla: config {cfg}: F16 1 (fp16 dots, scaled queries) needs ORIENT 1 and an FP8 or NVFP4 "
                         f"pool (latent_format {latent_format!r})")
    f16 = f16 or int(orient >= 2)   # ORIENT 2 / 3: fp16 value dots (their logits dots are fp8)
    dot_dt = tl.float32 if f32 else tl.float16 if f16 else tl.bfloat16
    if paging is None and selection is None:
        raise ValueError("mla: a dense context (no selection) needs the block table (paging)")
    tbl, req, MB, log_bs = paging if paging is not None else (pos, pos, 0, None)   # tbl, req unused when not PAGED
    if log_bs is None:   # rows given: a block view's rows split as (block, row in block)
        bs = int(block_size) if block_size is not None else (latent.shape[1] if latent.dim() == 3 else 1)
        log_bs = bs.bit_length() - 1
    sb, sr = pool_strides(lat, 1 << log_bs, 1, f"mla {latent_format} latent pool")
    qa, qp = q_abs.contiguous(), q_pe.contiguous()
    common = dict(KV=KV, DR=DR, BLOCK_H=bh, BLOCK_N=bn, FMT=fmt, SPARSE=selection is not None, DOT_DT=dot_dt,
                  PREC="ieee" if f32 else precision.low_bits(), PAGED=paging is not None, LOG_BS=log_bs,
                  PREFETCH=prefetch, num_warps=int(cfg["num_warps"]), num_stages=int(cfg["num_stages"]),
                  **launch_kwargs())
    if orient == 0:
        common["SUB"] = int(cfg.get("SUB", 1))
    elif orient == 1:
        common.update(QSCALE=f16, CVT=int(f16 and fmt == 1 and not f32), LSUM=lsum)
    else:
        common.update(CVT=int(not f32), KB=kb)
    kernel = (_mla_sparse_kernel, _mla_heads_kernel, _mla_rowsm_kernel, None)[orient]
    for t0 in range(0, T, tb):
        t1 = min(T, t0 + tb)
        po, plse = (o[t0:t1], lse[t0:t1]) if nsplit == 1 else (po_all[:t1 - t0], plse_all[:t1 - t0])
        if orient == 3:
            fold = (o[t0:t1], lse[t0:t1], tile_counters(dev, (t1 - t0) * -(-H // bh))) if fold_cfg else None
            _mla_gluon.launch((t1 - t0, -(-H // bh), nsplit), qa[t0:t1], qp[t0:t1], lat, sel[t0:t1], tbl,
                              req[t0:t1] if paging is not None else req, MB, po, plse, H, sel.shape[1], nsplit, chunk,
                              sb, sr, scale * LOG2E, vs, ps, KV=KV, DR=DR, BLOCK_H=bh,
                              STAGES=int(cfg["num_stages"]), PAGED=paging is not None, LOG_BS=log_bs,
                              launch_kw=launch_kwargs(), fold=fold)
            if nsplit > 1 and fold is None:
                combine_chunks(po, plse, o[t0:t1], lse[t0:t1])
            continue
        kernel[(t1 - t0, -(-H // bh), nsplit)](
            qa[t0:t1], qp[t0:t1], lat, sel[t0:t1] if selection is not None else sel, tbl,
            req[t0:t1] if paging is not None else req, MB, pos[t0:t1],
            po, plse, H, sel.shape[1] if selection is not None else 0, nsplit, chunk, sb, sr, scale * LOG2E,
            vs, ps, **common)
        if nsplit > 1:
            combine_chunks(po, plse, o[t0:t1], lse[t0:t1])
    return o, lse


def mla_sparse_decode(q_nope, q_pe, latent, kv_b, token_pos, token_req, block_table, block_size: int, scale: float,
                      selection=None, *,
                      latent_format: str = "bf16", latent_scale: float = 1.0, pe_scale: float = 1.0,
                      selection_rows: bool = False, return_lse: bool = False, latent_out: bool = False,
                      config: dict | None = None, max_context: int | None = None, nope_dim: int | None = None):
    """Absorbed MLA attention: o [T, H, dv] (latent_out: o~ [T, H, kv], the IR's form="latent", W_UV left
    to mla_value_proj), and lse [T, H] (natural log) when return_lse. q~ = W_UK^T q_nope and
    o = W_UV o~ are matmuls in q_nope's dtype around the kernel (q~: `absorb_queries`, one launch; the
    attention writes o~ in q_nope's dtype itself: form="latent" is 2 launches, 3 with split rows). `nope_dim`:
    q_nope already holds q~ [T, H, kv] (IR mla_attention {q_absorbed}, mla_absorb.py), nope_dim is dn."""
    T, H, dn = q_nope.shape
    dt = q_nope.dtype
    if nope_dim is not None and dn != kv_b.shape[1]:
        raise ValueError(f"mla: an absorbed query must be [T, H, kv={kv_b.shape[1]}], found {tuple(q_nope.shape)}")
    W_UK, W_UV = split_kv_b(kv_b, H, dn if nope_dim is None else int(nope_dim))
    q_abs = q_nope if nope_dim is not None else absorb_queries(q_nope, W_UK, dt)
    rows_given = selection is not None and selection_rows
    paging = None if rows_given else paging_args(block_table, token_req, block_size, q_nope.device)
    o_lat, lse = sparse_latent_attention(q_abs, q_pe.to(dt), latent, token_pos, paging, scale, selection,
                                         latent_format=latent_format, latent_scale=latent_scale,
                                         pe_scale=pe_scale, config=config, block_size=block_size,
                                         max_context=max_context, out_dtype=dt)
    o = o_lat if latent_out else torch.einsum("thk,hvk->thv", o_lat, W_UV.to(dt))
    return (o, lse) if return_lse else o


# ------------------------------------------------------------------------------------ template
def _launch(a, attrs, config):
    fmt = pool_format(a.latent, attrs)  # an FP8 IR pool holds e4m3 codes with per-layer scale 1 (SPEC §7)
    return mla_sparse_decode(a.q_nope, a.q_pe, a.latent, a.kv_b, a.token_pos, a.token_req, a.block_table,
                             int(attrs["block_size"]), float(attrs["scale"]), a.selection, latent_format=fmt, config=config,
                             selection_rows=attrs.get("selection_kind", "positions") == "rows",
                             latent_out=attrs.get("form") == "latent", max_context=attrs.get("max_context"),
                             nope_dim=int(attrs["nope_dim"]) if attrs.get("q_absorbed") else None)


def _key(a, attrs) -> dict:
    """H, L (selected rows, or the context bound), KV, sparse, fmt; T (tokens: the split size fills the GPU)
    and bi (batch-invariant mode: the split may not depend on T)."""
    H = int(a.q_nope.shape[1])
    T = a.q_nope.shape[0]
    T = int(T) if hasattr(T, "__index__") else 0
    if a.selection is not None:
        L = int(a.selection.shape[1])
    else:
        L = context_bound(a.token_pos, attrs)
    fmt = {"fp8": 1, "nvfp4": 2}.get(pool_format(a.latent, attrs), 0) if isinstance(a.latent, torch.Tensor) else 0
    return {"H": H, "L": L, "KV": int(a.kv_b.shape[1]), "sparse": int(a.selection is not None), "fmt": fmt,
            "T": T, "bi": int(bool(attrs.get("batch_invariant")))}


def _bucket(key: dict) -> dict:
    return dict(key, L=pow2_bucket(key["L"], 256), T=pow2_bucket(key.get("T", 0)))


def _constraints(config: dict, key: dict, target: str) -> list[str]:
    out = []
    if config.get("ORIENT", 0) == 1 and config.get("SUB", 1) != 1:
        out.append("ORIENT=1 reads whole rows (SUB=1)")
    if config.get("ORIENT", 0) != 1 and (config.get("PREFETCH", 0) == 2 or config.get("LSUM", 0)):
        out.append("PREFETCH=2 and LSUM=1 are ORIENT=1's")
    if config.get("ORIENT", 0) != 2 and config.get("KB", 128) != 128:
        out.append("KB is ORIENT=2's")
    if config.get("ORIENT", 0) == 1 and config["BLOCK_H"] * key.get("KV", 512) > 32 * config["num_warps"] * 128:
        out.append("ORIENT=1 accumulator BLOCK_H*kv fp32 over num_warps*32 threads > 128 registers each")
    if config.get("F16", 0) and (config.get("ORIENT", 0) != 1 or key.get("fmt", 0) == 0):
        out.append("F16 (fp16 dots) is ORIENT=1's, for FP8 / NVFP4 pools")
    if config.get("ORIENT", 0) == 2 and (key.get("fmt", 0) != 1 or config.get("SUB", 1) != 1 or config["BLOCK_N"] < 64
                                         and target != "cpu"):
        out.append("ORIENT=2 reads FP8 pools, whole rows (SUB=1), BLOCK_N >= 64 (wgmma M)")
    if config.get("ORIENT", 0) == 3 and (key.get("fmt", 0) != 1 or not key.get("sparse", 1) or target == "cpu"
                                         or config["BLOCK_N"] != 64 or config["BLOCK_H"] != 16
                                         or config["CHUNK"] % 64 or config["CHUNK"] > 1024
                                         or config["num_stages"] < 2 or config.get("SUB", 1) != 1):
        out.append("ORIENT=3 (Gluon, sm_90) reads FP8 pools through a selection: BLOCK_N 64, BLOCK_H 16, CHUNK a "
                   "multiple of 64 up to 1024, num_stages >= 2, whole rows")
    if config.get("FOLD") == 1 and (config.get("ORIENT", 0) != 3
                                    or -(-key.get("L", 1) // config["CHUNK"]) > FOLD_PIECES):
        out.append(f"FOLD 1 (pieces merged in the attention launch) is ORIENT=3's, for at most {FOLD_PIECES} pieces")
    if config.get("ORIENT", 0) == 3 and config["num_warps"] != 4:
        out.append("ORIENT=3 runs one warpgroup (num_warps 4)")
    if config["CHUNK"] % config["BLOCK_N"]:
        out.append(f"CHUNK {config['CHUNK']} is not a multiple of BLOCK_N {config['BLOCK_N']}")
    if target != "cpu":
        kv, width = key.get("KV", 512), key.get("KV", 512) + 64
        if config["BLOCK_H"] * kv > 32 * 512:
            out.append("accumulator BLOCK_H*kv > 16384 fp32 values spills")
        elem = 1 if key.get("fmt", 0) else 2
        smem = config["BLOCK_N"] * width * 2 * max(1, config["num_stages"]) * (1 if config.get("SUB", 1) == 1 else 0.25) \
            + config["BLOCK_N"] * width * elem * (config["num_stages"] - 1) + config["BLOCK_H"] * width * 2
        if config.get("ORIENT", 0) == 3:   # row buffers, split queries, P, the row table
            bn, bh = config["BLOCK_N"], config["BLOCK_H"]
            smem = config["num_stages"] * bn * width + 2 * bh * width + bh * bn * 2 + config["CHUNK"] * 4
        if config.get("ORIENT", 0) == 2:   # stages of e4m3 rows, the split query, one widened block
            smem = config["BLOCK_N"] * width * max(1, config["num_stages"]) + config["BLOCK_H"] * width * 2 \
                + config["BLOCK_N"] * config.get("KB", 128) * 2
        if smem > 227 * 1024:
            out.append(f"shared memory ~{int(smem)} B for BLOCK_N={config['BLOCK_N']}, num_stages={config['num_stages']}")
    return out


def _supports(a, attrs, target) -> str | None:
    try:
        kv, dr = int(a.kv_b.shape[1]), int(a.q_pe.shape[2])
    except TypeError:
        return "kv_lora_rank / qk_rope_head_dim are not concrete integers"
    if kv & (kv - 1) or dr & (dr - 1) or kv < 32 or dr < 16:
        return f"kv {kv} / dr {dr} are not powers of two (kv >= 32, dr >= 16)"
    return pool_and_selection_problem(a, attrs)


def pool_format(latent: torch.Tensor, attrs: dict) -> str:
    """The kernels' latent_format of an IR latent pool tensor (NVFP4 rows are u8 with latent_format=nvfp4)."""
    if attrs.get("latent_format", "plain") == "nvfp4":
        return "nvfp4"
    return {torch.float32: "fp32", torch.float8_e4m3fn: "fp8"}.get(latent.dtype, "bf16")


def pool_and_selection_problem(a, attrs) -> str | None:
    """Why an `mla_attention` node's latent pool or selection cannot be read here (None when it can)."""
    if attrs.get("latent_format", "plain") == "nvfp4":
        pass  # u8 NVFP4 rows (the op's type rule checked the width)
    elif getattr(a.latent.dtype, "name", "") not in ("bf16", "f32", "f8e4m3"):
        return f"latent pool dtype {getattr(a.latent.dtype, 'name', a.latent.dtype)} (IR pools are bf16/f32/f8e4m3)"
    if attrs.get("selection_kind", "positions") not in ("positions", "rows"):
        return f"selection_kind {attrs['selection_kind']!r} (reads positions or rows)"
    return None


TUNABLES = (
    Tunable("BLOCK_H", (16, 32)),
    Tunable("BLOCK_N", (16, 32, 64, 128)),
    Tunable("CHUNK", (32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)),
    Tunable("num_warps", (4, 8)),
    Tunable("num_stages", (1, 2, 3)),
    Tunable("SUB", (1, 4)),
    Tunable("PREFETCH", (0, 1, 2)),
    Tunable("LSUM", (0, 1)),
    Tunable("ORIENT", (0, 1, 2, 3)),
    Tunable("KB", (64, 128, 256)),
    Tunable("F16", (0, 1)),
)

TEMPLATES = [
    KernelTemplate(family="mla_sparse", backend="triton", ops=("mla_attention",), launch=_launch, key_dims=_key,
                   heuristic=heuristic, tunables=TUNABLES, bucket=_bucket, constraints=_constraints,
                   supports=_supports, batch_invariant=True,
                   doc="absorbed MLA over selected (or all causal) latent rows, chunked + LSE combine"),
]
