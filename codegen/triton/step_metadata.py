"""One fused kernel that expands a step's packed request table into the entry functions' metadata.

Input: one int32 buffer (copied host -> device once per step), laid out as
    header   [R, 4]   per request r: cached length L_r, new-token count n_r, state slot s_r, block count b_r
    blocks   [sum b]  every request's block ids, request after request
    tokens   [T]      the step's token ids, request after request (T = sum n_r)
Outputs (written in place, so they may be a CUDA graph's static input buffers), with
cu_r = n_0 + ... + n_{r-1} and o_r = b_0 + ... + b_{r-1}:
    tokens      i64[T]      tokens[cu_r + i]     = packed token cu_r + i
    token_pos   i64[T]      token_pos[cu_r + i]  = L_r + i              (0 <= i < n_r)
    token_req   i64[T]      token_req[cu_r + i]  = r
    cu_seqlens  i64[R + 1]  cu_seqlens[r]        = cu_r, cu_seqlens[R] = T
    block_table i32[R, W]   block_table[r, j]    = blocks[o_r + j] for j < b_r, else -1
    state_slot  i64[R]      state_slot[r]        = s_r
One program per request; the prefix sums cu_r and o_r are each program's own masked sums over the
header (R is at most a few thousand), so no second launch is needed. This is exactly what
`ReferenceRuntime._metadata` builds with six host lists and six tensor copies.

Fed tokens (`feed=`, an int64 device tensor): a packed token -1 - i stands for feed[i], the id a sampler
wrote there on the device after the previous step, so the next step is launched before the host has
read that id (the engine's asynchronous decode); a negative id found there (a row the sampler refused)
reads as 0 for a step whose result is discarded anyway.

Strided layout (`strided=True`, what a CUDA graph captures): the blocks region is [R, W], request r's
ids at o_r = r * W (unused entries -1), so every offset is fixed by (R, W) and the launch's arguments
never change between replays; only the buffer's contents do.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

HEADER = 4  # ints per request in the packed header: length, count, slot, blocks


@triton.jit
def _step_metadata_kernel(packed, R, W, blocks_at, tokens_at, feed,
                          tokens, token_pos, token_req, cu_seqlens, block_table, state_slot,
                          RB: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_W: tl.constexpr, STRIDED: tl.constexpr,
                          FEED: tl.constexpr):
    r = tl.program_id(0)
    idx = tl.arange(0, RB)
    before = idx < r
    counts = tl.load(packed + idx * 4 + 1, mask=idx < R, other=0)
    nblk = tl.load(packed + idx * 4 + 3, mask=idx < R, other=0)
    cu = tl.sum(tl.where(before, counts, 0), axis=0)      # first token row of request r
    if STRIDED:
        boff = r * W                                      # fixed stride: row r of a [R, W] region
    else:
        boff = tl.sum(tl.where(before, nblk, 0), axis=0)  # its first block id in the blocks region
    length = tl.load(packed + r * 4)
    n = tl.load(packed + r * 4 + 1)
    slot = tl.load(packed + r * 4 + 2)
    nb = tl.load(packed + r * 4 + 3)
    tl.store(state_slot + r, slot.to(tl.int64))
    tl.store(cu_seqlens + r, cu.to(tl.int64))          # programs r and r-1 write the same cu_r
    tl.store(cu_seqlens + r + 1, (cu + n).to(tl.int64))
    for t0 in range(0, n, BLOCK_T):
        i = t0 + tl.arange(0, BLOCK_T)
        m = i < n
        row = (cu + i).to(tl.int64)
        tok = tl.load(packed + tokens_at + row, mask=m, other=0).to(tl.int64)
        if FEED:  # -1 - i: the id the previous step's sampler left at feed[i] (a failed row's -1 reads as 0)
            fed = tl.load(feed + (-1 - tok), mask=m & (tok < 0), other=0)
            tok = tl.where(tok < 0, tl.maximum(fed, 0), tok)
        tl.store(tokens + row, tok, mask=m)
        tl.store(token_pos + row, (length + i).to(tl.int64), mask=m)
        tl.store(token_req + row, (i * 0 + r).to(tl.int64), mask=m)
    for j0 in range(0, W, BLOCK_W):
        j = j0 + tl.arange(0, BLOCK_W)
        blk = tl.load(packed + blocks_at + boff + j, mask=j < nb, other=-1)
        tl.store(block_table + r.to(tl.int64) * W + j, blk, mask=j < W)


def expand_step_metadata(packed: torch.Tensor, n_requests: int, n_tokens: int, n_block_ids: int, width: int,
                         out: dict[str, torch.Tensor] | None = None, strided: bool = False,
                         feed: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
    """Run the kernel on a packed int32 buffer already on its device (layout in the module doc; `strided`:
    the blocks region is [R, width], n_block_ids = R * width). `out` gives the six output tensors (exact
    shapes and dtypes above) to write into; else they are allocated. `feed`: where tokens -1 - i are read
    (int64, on the buffer's device). Returns {"tokens", "token_pos",
    "token_req", "cu_seqlens", "block_table", "state_slot"}."""
    R, T, W = int(n_requests), int(n_tokens), int(width)
    if strided and int(n_block_ids) != R * W:
        raise ValueError(f"step metadata: the strided layout holds R * width = {R * W} block ids, got {n_block_ids}")
    want = HEADER * R + int(n_block_ids) + T
    if packed.dtype != torch.int32 or packed.dim() != 1 or packed.numel() < want:
        raise ValueError(f"step metadata: packed buffer must be int32 [>= {want}] for {R} requests, "
                         f"{n_block_ids} block ids and {T} tokens; got {packed.dtype} {tuple(packed.shape)}")
    if R < 1 or W < 1:
        raise ValueError(f"step metadata: need at least one request and a table width >= 1, got R={R}, W={W}")
    dev = packed.device
    shapes = {"tokens": ((T,), torch.int64), "token_pos": ((T,), torch.int64), "token_req": ((T,), torch.int64),
              "cu_seqlens": ((R + 1,), torch.int64), "block_table": ((R, W), torch.int32),
              "state_slot": ((R,), torch.int64)}
    if out is None:
        out = {k: torch.empty(s, dtype=d, device=dev) for k, (s, d) in shapes.items()}
    bad = [f"{k}: {tuple(out[k].shape)} {out[k].dtype} on {out[k].device}, want {s} {d} on {dev}"
           for k, (s, d) in shapes.items()
           if k not in out or tuple(out[k].shape) != s or out[k].dtype != d or out[k].device != dev
           or not out[k].is_contiguous()]
    if bad:
        raise ValueError("step metadata: output buffers do not match: " + "; ".join(bad))
    if feed is not None and (feed.dtype != torch.int64 or feed.device != dev or not feed.is_contiguous()):
        raise ValueError(f"step metadata: feed must be a contiguous int64 tensor on {dev}, got {feed.dtype} on "
                         f"{feed.device}")
    _step_metadata_kernel[(R,)](packed, R, W, HEADER * R, HEADER * R + int(n_block_ids),
                                feed if feed is not None else packed,
                                out["tokens"], out["token_pos"], out["token_req"], out["cu_seqlens"],
                                out["block_table"], out["state_slot"],
                                RB=triton.next_power_of_2(R), BLOCK_T=64, BLOCK_W=min(256, triton.next_power_of_2(W)),
                                STRIDED=bool(strided), FEED=feed is not None, num_warps=4 if R > 256 else 1)
    return out


TEMPLATES: list = []  # not an IR op: the runtime calls expand_step_metadata directly
