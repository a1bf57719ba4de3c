"""Gluon grouped gate-up of the routed experts on wgmma (config GGX = 1 with GG; issue 5's T=64 decode): the decoded
MXFP4 weights are a warpgroup wgmma's A operand in registers, the tiles' activations its B operand in shared memory.
Same contract as `_moe_grouped_gluon._grouped_gate_up_kernel` (the permutation of `permute_tokens`, h in the
expert-sorted row order, SiTU-GLU / SwiGLU epilogue, HP column order for the Gluon down kernel); the words are decoded
by the same `_a_mul` (DEC 1), so the products are the same bf16 products, summed in fp32 in another order.

Why (benches/results/h200-2026-12-02-s23, `_moe_ablation.py`): the register form is not bound by HBM (with its weights
L1/L2-resident it still takes 0.50 of 0.59 ms, uncapped) but by its instruction stream: its skeleton alone (mma.sync,
the word loads, the loop) 0.24 ms, the activation path (every warp loading the same B columns, 2 bytes per weight
byte, and pairing them by PRMT) 0.07, the decode 0.07. Here one warpgroup holds 64 weight rows (a warp 16, as the
register form's W4 x MT1), the B tile [BN tokens, 32·NWT columns] of a K step is copied once per program into a ring of
shared memory (cp.async, 16 bytes a copy; one barrier a step, where the warpgroup's wgmmas already align its warps) and
read by the tensor cores, and each matrix's step is one asynchronous wgmma chain (m64 n16 k16), the second matrix's
decode overlapping the first's.

Column order. `_a_mul(..., WG=1)` labels a thread's registers with the logical columns `logical_columns` gives (the
wgmma register fragment's k: a, then t = lane % 4, then the code pair's c0, c1, then the word j), so no value moves;
the activations must be in that order: `permute_columns` (one gather of z's columns per launch, z [T, l] is 0.46 MB at
T=64) writes z's columns k-th at `logical_columns`' position, and the ring copies 16-byte pieces of those rows.

CUDA sm_90 only (wgmma; never the interpreter): `usable`; else the register form runs.
"""
from __future__ import annotations

import functools
import os

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy as cp
from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, tma, warpgroup_mma,
                                                              warpgroup_mma_wait)

from codegen.triton import _moe_grouped_gluon as gg
from codegen.triton._moe_grouped_gluon import _a_mul, _hp_column, _row_offsets
from codegen.triton._moe_host import _wide_scales
from codegen.triton._moe_tiles import _glu
from codegen.triton._pdl import launch_kwargs, pdl_enter

_barrier = getattr(gl, "barrier", None) or gl.thread_barrier      # Triton 3.7 / 3.6 name of the CTA barrier


@functools.lru_cache(maxsize=None)
def logical_columns(ell: int, nwt: int = 4) -> tuple:
    """For each logical column of the wgmma operand (k = 32j + 16c1 + 8c0 + 2t + a within a step of 32·NWT), the
    physical column of z it multiplies: code c + 4a (c = 2c1 + c0) of word NWT·t + j, i.e. 8(NWT·t + j) + c + 4a."""
    out = []
    for k in range(ell):
        st, r = divmod(k, 32 * nwt)
        j, c1, c0, t, a = r // 32, (r >> 4) & 1, (r >> 3) & 1, (r >> 1) & 3, r & 1
        out.append(32 * nwt * st + 8 * (nwt * t + j) + 2 * c1 + c0 + 4 * a)
    return tuple(out)


_INDEX: dict = {}


def permute_columns(z: torch.Tensor, nwt: int = 4) -> torch.Tensor:
    """z [T, l] with its columns in `logical_columns` order (a new contiguous tensor). The index tensor is made once
    per (l, NWT, device), on the first call (an eager one: a CUDA graph cannot capture its host-to-device copy)."""
    key = (z.shape[1], nwt, z.device)
    idx = _INDEX.get(key)
    if idx is None:
        idx = _INDEX[key] = torch.tensor(logical_columns(z.shape[1], nwt), dtype=torch.long, device=z.device)
    return z.index_select(1, idx)


@gluon.jit
def _b_rows(zp_ptr, pair_ptr, pos0, n_live, stride_z, TOPK: gl.constexpr, BN: gl.constexpr, KS: gl.constexpr,
            BL: gl.constexpr):
    """Pointers [BN, KS] to step 0's permuted columns of the tile's tokens (rows pos0 + n of the permutation; n >=
    n_live: the first row's token, never stored)."""
    n = gl.arange(0, BN, layout=gl.SliceLayout(1, BL))
    tok = gl.load(pair_ptr + pos0 + gl.where(n < n_live, n, 0)) // TOPK
    k = gl.arange(0, KS, layout=gl.SliceLayout(0, BL))
    return zp_ptr + gl.expand_dims(tok.to(gl.int64) * stride_z, 1) + gl.expand_dims(k, 0)


@gluon.jit
def _fetch_words(d1, d3, w1s, w3s, bars, k, total, row, STEPS, S: gl.constexpr, NWT: gl.constexpr, M: gl.constexpr):
    """Step k's words of w1 and w3 (k counts (N tile, step) pairs; nothing at or past `total`) into slot k % S."""
    b = k % S
    ok = k < total
    mbarrier.expect(bars.index(b), 2 * M * 16 * NWT, pred=ok)
    col = ((k % STEPS) * 4).to(gl.int32)
    tma.async_copy_global_to_shared(d1, [row, col, 0], bars.index(b), w1s.index(b), pred=ok)
    tma.async_copy_global_to_shared(d3, [row, col, 0], bars.index(b), w3s.index(b), pred=ok)


@gluon.jit
def _wg_gate_up_kernel(zp_ptr, pair_ptr, counts_ptr, offsets_ptr, d1, d3, s1_ptr, s3_ptr, h_ptr, stride_z,
                       stride_se, stride_sn, stride_h, beta1, beta2, NRB, STEPS, INTER, TOPK: gl.constexpr,
                       ACT: gl.constexpr, HAS_BETA2: gl.constexpr, NWT: gl.constexpr, BN: gl.constexpr,
                       S: gl.constexpr, WIDE: gl.constexpr, PDL: gl.constexpr, MMA: gl.constexpr, A4: gl.constexpr,
                       DA: gl.constexpr, BL: gl.constexpr, ZS: gl.constexpr, RL: gl.constexpr, HP: gl.constexpr = 0):
    """h[pos, rows] = act(W1_e z_t, W3_e z_t) for expert e = pid // NRB's tokens and weight rows (pid % NRB)·64 ..
    + 64 (module doc): the words and the B columns S - 1 steps ahead in shared memory, the scale bytes one step ahead
    in registers."""
    M: gl.constexpr = 64
    KS: gl.constexpr = 32 * NWT
    e = gl.program_id(0) // NRB
    r0 = (gl.program_id(0) % NRB) * M
    row = (e * INTER + r0).to(gl.int32)
    w1s = gl.allocate_shared_memory(gl.int32, [S, M, 4, NWT], RL)
    w3s = gl.allocate_shared_memory(gl.int32, [S, M, 4, NWT], RL)
    zs = gl.allocate_shared_memory(gl.bfloat16, [S, BN, KS], ZS)
    bars = gl.allocate_shared_memory(gl.int64, [S, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(S):
        mbarrier.init(bars.index(i), count=1)
    fence_async_shared()
    _barrier()
    pdl_enter(PDL)          # counts, offsets, pair ids and z come from earlier launches
    cnt = gl.load(counts_ptr + e)
    pos0 = gl.load(offsets_ptr + e)
    total = gl.cdiv(cnt, BN) * STEPS
    for i in gl.static_range(S - 1):
        _fetch_words(d1, d3, w1s, w3s, bars, i, total, row, STEPS, S, NWT, M)
    soff = _row_offsets(r0, 0, stride_sn, A4, M, NWT)[1]
    s1r = s1_ptr + e.to(gl.int64) * stride_se + soff
    s3r = s3_ptr + e.to(gl.int64) * stride_se + soff
    LW: gl.constexpr = gl.SliceLayout(3, A4)
    rm = r0 + gl.arange(0, M, layout=gl.SliceLayout(1, MMA))
    rn = gl.arange(0, BN, layout=gl.SliceLayout(0, MMA))
    k = 0
    for n0 in range(0, cnt, BN):
        zr = _b_rows(zp_ptr, pair_ptr, pos0 + n0, cnt - n0, stride_z, TOPK, BN, KS, BL)
        for i in gl.static_range(S - 1):
            cp.async_copy_global_to_shared(zs.index(i), zr + gl.minimum(i, STEPS - 1) * KS)
            cp.commit_group()
        s1n = gl.load(s1r)
        s3n = gl.load(s3r)
        acc1 = gl.zeros([M, BN], gl.float32, MMA)
        acc3 = gl.zeros([M, BN], gl.float32, MMA)
        for st in range(STEPS):
            s1, s3 = s1n, s3n
            nx = gl.minimum(st + 1, STEPS - 1)        # the last step reloads its own (cache hits)
            s1n = gl.load(s1r + nx * NWT)
            s3n = gl.load(s3r + nx * NWT)
            cp.wait_group(S - 2)
            fence_async_shared()
            _barrier()      # step st's B columns in (every thread's copies); every warp done with step k - 1's slots
            cp.async_copy_global_to_shared(zs.index((st + S - 1) % S), zr + gl.minimum(st + S - 1, STEPS - 1) * KS)
            cp.commit_group()
            _fetch_words(d1, d3, w1s, w3s, bars, k + S - 1, total, row, STEPS, S, NWT, M)
            slot = k % S
            mbarrier.wait(bars.index(slot), (k // S) & 1)
            w1 = w1s.index(slot).permute((0, 2, 1)).load(LW)
            w3 = w3s.index(slot).permute((0, 2, 1)).load(LW)
            b = zs.index(st % S).permute((1, 0))
            acc1 = warpgroup_mma(_a_mul(w1, s1, A4, DA, M, NWT, WIDE, 1), b, acc1, is_async=True)
            acc3 = warpgroup_mma(_a_mul(w3, s3, A4, DA, M, NWT, WIDE, 1), b, acc3, is_async=True)
            acc1, acc3 = warpgroup_mma_wait(0, deps=[acc1, acc3])     # the A registers free for the next step
            k += 1
        cp.wait_group(0)
        h = _glu(acc1, acc3, beta1, beta2, ACT, HAS_BETA2).to(gl.bfloat16)
        col = n0 + rn
        rs = _hp_column(rm, HP) if HP else rm
        out = h_ptr + gl.expand_dims((pos0 + col).to(gl.int64) * stride_h, 0) + gl.expand_dims(rs, 1)
        gl.store(out, h, mask=gl.expand_dims(col < cnt, 0) & gl.expand_dims(rm >= 0, 1))
        _barrier()              # the B ring's slots free before the next N tile's copies
    for i in gl.static_range(S):
        mbarrier.invalidate(bars.index(i))


def enabled(cfg: dict) -> bool:
    return bool(int(cfg.get("GGX") or 0))


def usable(z: torch.Tensor, w1, w3, cfg: dict, split: int) -> bool:
    """GGX = 1 on top of the register form's conditions (`_moe_grouped_gluon.usable`), sm_90 exactly (wgmma), the
    tiling W4 x MT1 (64 rows a program: one wgmma M), NWT 4, BN 16."""
    if not (enabled(cfg) and gg.usable(z, w1, w3, cfg, split)):
        return False
    if os.environ.get("TRITON_INTERPRET") == "1" or torch.cuda.get_device_capability(z.device) != (9, 0):
        return False
    q1, q3 = gg._words(w1)[0], gg._words(w3)[0]
    aligned = all(q.stride(1) % 4 == 0 and q.stride(0) == q.shape[1] * q.stride(1) and q.data_ptr() % 16 == 0
                  for q in (q1, q3))     # TMA: 16-byte aligned rows, a view over (expert, row)
    return gg.tiles(cfg) == (4, 1, 4, 16) and aligned


def layouts(bn: int, nwt: int) -> dict:
    """The accumulator (version 3, [64, BN]), the A operand (k_width 2), the B ring's shared layout and the copy
    layout (16 bytes a thread, a warp over 4 rows of 32·NWT bf16)."""
    mma = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, bn, 16])
    return dict(MMA=mma, DA=gl.DotOperandLayout(operand_index=0, parent=mma, k_width=2),
                BL=gl.BlockedLayout([1, 8], [32 // (4 * nwt), 4 * nwt], [4, 1], [1, 0]),
                ZS=gl.NVMMASharedLayout.get_default_for([bn, 32 * nwt], gl.bfloat16))


def gate_up(z, seg, w1, w3, h, glu: dict, betas: tuple, cfg: dict, hp: int = 0) -> None:
    """h [T·k, I] as `_moe_grouped_gluon.gate_up` (`usable` checked first)."""
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor
    (q1, s1), (q3, s3) = gg._words(w1), gg._words(w3)
    E, inter, ell = int(q1.shape[0]), int(q1.shape[1]), z.shape[1]
    _, _, nwt, bn = gg.tiles(cfg)
    zp = permute_columns(z, nwt)
    rl = gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=32, rank=3)
    desc = [TensorDescriptor.from_tensor(q.view(E * inter, q.shape[2] // nwt, nwt), [64, 4, nwt], rl) for q in (q1, q3)]
    _wg_gate_up_kernel[(E * (inter // 64),)](
        zp, seg.pair_ids, seg.counts, seg.offsets, *desc, s1, s3, h, zp.stride(0), s1.stride(0), s1.stride(1),
        h.stride(0), *betas, inter // 64, ell // (32 * nwt), inter, TOPK=seg.topk, NWT=nwt, BN=bn,
        S=int(cfg.get("GGS", 4)), WIDE=_wide_scales(s1) or _wide_scales(s3), num_warps=4,
        **({"maxnreg": int(cfg["GGR"])} if cfg.get("GGR") else {}), **glu, A4=gg.layouts(4, 1, nwt, bn)["A4"],
        RL=rl, **layouts(bn, nwt), **launch_kwargs(), **({"HP": int(hp)} if hp else {}))
