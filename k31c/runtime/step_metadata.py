"""A step's metadata in one host->device copy and one kernel (`codegen/triton/step_metadata.py`).

A step's six metadata tensors (tokens, token_pos, token_req, cu_seqlens, block_table, state_slot) are
built on the host with `host_metadata` (CPU) or, on a GPU, by `StepMetadataBuilder`: the host only
writes one int32 buffer, per request (cached length, new-token count, slot, block count), then
all block ids, then all tokens; a pinned staging buffer is copied to the device once, and the fused
kernel expands it, optionally straight into a CUDA graph's static input buffers (`out=`).

    meta = StepMetadataBuilder(device).build(rows)              # rows = check_step(rt, fn, chunks)
    meta = StepMetadataBuilder(device).build(rows, width=W, pad_to=8, scratch=(blk, slot), out=static)

Padding (for a batch-size bucket): requests R..pad_to-1 are decode requests of one token 0 at
position 0 whose block table is [scratch block, -1, ...] and whose state slot is the scratch slot, so
whatever a padded row writes lands in memory no real request owns.

Inside a CUDA graph (`GraphMetadata`): the kernel is captured as the graph's first node, over the strided
layout whose offsets depend only on the bucket (B, W); a replay then costs the host one numpy write of a
pinned buffer, one asynchronous copy and the replay (no kernel launch of its own, no wait on the device).

    gm = GraphMetadata(B, W, scratch, device)          # before capture
    gm.expand(static_inputs)                            # inside the capture (and its warm-up)
    gm.write(rows); gm.upload(); graph.replay()         # per step

The block ids of a replayed step come from `BlockRows`, an int32 mirror of every request's block list grown
by the blocks added since the last step, and `check_step(copy_blocks=False)` skips its list copies: writing
Python lists of block ids into the pinned buffer costs the host ~9 us per 512 ids, a mirror row is a memcpy.
CPU machine, check_step + rows + write at batch 64 x 512 blocks (32K, 64-token blocks): 795 us with lists,
162 with the mirror; the H200 replays that step's graph in 2.55 ms.
"""

from __future__ import annotations

from typing import Mapping, Sequence

import numpy as np
import torch

from .pinned import PinnedPair

Row = tuple[int, int, list[int], list[int]]  # (cached length, state slot, block ids, new tokens)


def check_step(rt, fn: str, chunks: Mapping[str, Sequence[int]], resolve_fed: bool = True,
               copy_blocks: bool = True) -> list[Row]:
    """Validate a step of runtime `rt` (a RequestError naming every problem at once) and return one Row per
    request in `chunks` order. A decode token -1 - i stands for `rt.token_feed[i]`; `resolve_fed` reads
    those ids on the host (one copy), else they stay negative for the graph's metadata kernel to read.
    `copy_blocks=False` leaves each row's block ids empty (a caller with its own copy: `BlockRows`)."""
    from .reference import RequestError

    problems = []
    feed = getattr(rt, "token_feed", None)
    n_feed = len(feed) if feed is not None and fn == "decode" else 0
    fed_ids = None
    if not chunks:
        problems.append("a step needs at least one request")
    limit = rt.module.function(fn).attrs.get("max_tokens_per_request")
    rows: list[Row] = []
    for rid, toks in chunks.items():
        r = rt.requests.get(rid)
        if r is None:
            problems.append(f"unknown request {rid!r}")
            continue
        toks = [int(t) for t in toks]
        if not toks:
            problems.append(f"request {rid!r}: no tokens in this step")
        if limit is not None and len(toks) > limit:
            problems.append(f"request {rid!r}: {fn} takes at most {limit} tokens per request, got {len(toks)}")
        if resolve_fed and any(-n_feed <= t < 0 for t in toks):
            fed_ids = feed.tolist() if fed_ids is None else fed_ids
            toks = [fed_ids[-1 - t] if -n_feed <= t < 0 else t for t in toks]
        bad = [t for t in toks if not (0 <= t < rt.vocab_size or (not resolve_fed and -n_feed <= t < 0))]
        if bad:
            problems.append(f"request {rid!r}: token ids {bad[:5]} outside the vocabulary [0, {rt.vocab_size})")
        if r.length + len(toks) > r.capacity:
            problems.append(f"request {rid!r}: {r.length} cached + {len(toks)} new tokens exceed its "
                            f"capacity {r.capacity}")
        rows.append((r.length, r.slot, list(r.blocks) if copy_blocks else [], toks))
    if problems:
        raise RequestError(f"{fn} step rejected: " + "; ".join(problems))
    return rows


def host_metadata(rows: Sequence[Row], device) -> dict[str, torch.Tensor]:
    """The metadata tensors of `rows` built with torch on the host (what the fused kernel computes)."""
    tokens, pos, req, cu = [], [], [], [0]
    for r_index, (length, _, _, toks) in enumerate(rows):
        tokens += toks
        pos += range(length, length + len(toks))
        req += [r_index] * len(toks)
        cu.append(cu[-1] + len(toks))

    def t(x):
        return torch.tensor(x, dtype=torch.int64, device=device)

    width = max(len(b) for _, _, b, _ in rows)
    table = torch.tensor([b + [-1] * (width - len(b)) for _, _, b, _ in rows], dtype=torch.int32, device=device)
    return {"tokens": t(tokens), "token_pos": t(pos), "token_req": t(req), "cu_seqlens": t(cu),
            "block_table": table, "state_slot": t([slot for _, slot, _, _ in rows])}


def pack_rows(rows: Sequence[Row], pad_to: int | None = None, scratch: tuple[int, int] | None = None) -> list[int]:
    """The packed int32 layout of the kernel: header [R, 4], block ids, tokens (padding rows appended)."""
    rows = list(rows)
    if pad_to is not None and pad_to > len(rows):
        if scratch is None:
            raise ValueError(f"padding {len(rows)} requests to {pad_to} needs a scratch (block, slot)")
        rows += [(0, scratch[1], [scratch[0]], [0])] * (pad_to - len(rows))
    head, blocks, tokens = [], [], []
    for length, slot, blks, toks in rows:
        head += (length, len(toks), slot, len(blks))
        blocks += blks
        tokens += toks
    return head + blocks + tokens


class StepMetadataBuilder:
    """Builds a step's metadata on `device` with one copy and one launch, reusing a pinned staging buffer
    (an event guards it: the host rewrites it only after the previous copy has finished)."""

    def __init__(self, device: str | torch.device = "cpu"):
        self.device = torch.device(device)
        self._stage: torch.Tensor | None = None
        self._dev: torch.Tensor | None = None
        self._copied: torch.cuda.Event | None = None

    def _buffers(self, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        if self._stage is None or self._stage.numel() < n:
            size = max(1024, 1 << (n - 1).bit_length())
            cuda = self.device.type == "cuda"
            self._stage = torch.empty(size, dtype=torch.int32, pin_memory=cuda)
            self._dev = torch.empty(size, dtype=torch.int32, device=self.device) if cuda else self._stage
            self._copied = None
        return self._stage, self._dev

    def build(self, rows: Sequence[Row], *, width: int | None = None, pad_to: int | None = None,
              scratch: tuple[int, int] | None = None,
              out: dict[str, torch.Tensor] | None = None) -> dict[str, torch.Tensor]:
        """Metadata of `rows` (from `check_step`), padded to `pad_to` requests with `scratch`; the table
        is `width` blocks wide (default: the widest request's block list)."""
        from codegen.triton.step_metadata import HEADER, expand_step_metadata

        if not rows:
            raise ValueError("step metadata: no requests")
        need = max(len(b) for _, _, b, _ in rows)
        width = need if width is None else int(width)
        if width < need:
            raise ValueError(f"step metadata: table width {width} is narrower than a request's {need} blocks")
        flat = pack_rows(rows, pad_to, scratch)
        n_req = max(len(rows), pad_to or 0)
        n_tok = sum(len(t) for *_, t in rows) + (n_req - len(rows))
        n_blk = len(flat) - HEADER * n_req - n_tok
        stage, dev = self._buffers(len(flat))
        if self._copied is not None:
            self._copied.synchronize()  # the previous step's copy out of the staging buffer is done
        stage[:len(flat)] = torch.tensor(flat, dtype=torch.int32)
        if dev is not stage:
            dev[:len(flat)].copy_(stage[:len(flat)], non_blocking=True)
            self._copied = torch.cuda.Event()
            self._copied.record()
        return expand_step_metadata(dev, n_req, n_tok, n_blk, width, out=out)


class BlockRows:
    """Per request id, its block ids as an int32 array, kept in step with the runtime's list: a request's list
    only grows within its life (`ReferenceRuntime.grow` appends; release and re-admission make a new request
    object), so each call converts only the blocks added since the previous one; a new request object under
    the same id, or a list that got shorter, starts its row again."""

    def __init__(self):
        self._rows: dict[str, tuple[object, np.ndarray, int]] = {}  # rid -> (request, buffer, ids mirrored)

    def row(self, rid: str, request) -> np.ndarray:
        """`request.blocks` as an int32 array (a view of the mirror: valid until the next call for `rid`)."""
        blocks = request.blocks
        req, buf, n = self._rows.get(rid, (None, None, 0))
        if req is not request or n > len(blocks):
            buf, n = np.empty(max(16, len(blocks)), dtype=np.int32), 0
        if n < len(blocks):
            if len(blocks) > len(buf):
                buf = np.concatenate([buf[:n], np.empty(max(len(blocks), 2 * len(buf)) - n, dtype=np.int32)])
            buf[n:len(blocks)] = blocks[n:]
            n = len(blocks)
        self._rows[rid] = (request, buf, n)
        return buf[:n]

    def __len__(self) -> int:
        return len(self._rows)

    def forget(self, keep) -> None:
        """Drop the mirrors of request ids not in `keep`."""
        for rid in [r for r in self._rows if r not in keep]:
            del self._rows[rid]


class GraphMetadata:
    """The metadata of one decode graph of bucket (B requests, W-block tables). The host fills one of two
    pinned int32 buffers in the strided layout (header [B, 4], blocks [B, W], tokens [B]; a token -1 - i
    reads `feed[i]` on the device), `upload` copies it (asynchronously) into one device buffer, and
    `expand`, the graph's first node, expands that buffer into the graph's static inputs. The device
    buffer is ordered by the stream (the copy for a step runs after the previous replay has read it); a
    pinned buffer is rewritten only after its last copy has run (an event each), so the host can prepare
    step N+1 while step N runs (`pinned.PinnedPair`)."""

    def __init__(self, batch: int, width: int, scratch: tuple[int, int], device, feed: torch.Tensor | None = None):
        from codegen.triton.step_metadata import HEADER

        self.B, self.W, self.scratch, self.feed = int(batch), int(width), scratch, feed
        self.blocks_at = HEADER * self.B
        self.tokens_at = self.blocks_at + self.B * self.W
        n = self.tokens_at + self.B
        self.stages = PinnedPair(n, torch.int32, device)
        self.dev = torch.empty(n, dtype=torch.int32, device=device) if self.stages.cuda else self.stages.bufs[0]
        self._stage = None
        self.write([])  # every row a padding row: what the warm-up and the capture run on
        self.upload()

    def write(self, rows: Sequence[Row]) -> None:
        """Fill the next pinned buffer with `rows` (decode rows: one new token each; at most B of them, at
        most W blocks each), padded with scratch-only rows."""
        n, B, W = len(rows), self.B, self.W
        if n > B:
            raise ValueError(f"graph metadata: {n} requests do not fit the batch bucket {B}")
        self._stage = self.stages.take(self.dev.numel())
        h = self._stage.numpy()
        head = h[:self.blocks_at].reshape(B, 4)
        blocks = h[self.blocks_at:self.tokens_at].reshape(B, W)
        toks = h[self.tokens_at:]
        for r, (length, slot, blks, new) in enumerate(rows):
            if len(new) != 1 or len(blks) > W:
                raise ValueError(f"graph metadata: row {r} has {len(new)} new tokens and {len(blks)} blocks; a "
                                 f"decode graph takes 1 token and at most {W} blocks per request")
            head[r] = (length, 1, slot, len(blks))
            blocks[r, :len(blks)] = blks
            toks[r] = new[0]
        if n < B:
            head[n:] = (0, 1, self.scratch[1], 1)
            blocks[n:, 0] = self.scratch[0]
            toks[n:] = 0

    def upload(self) -> None:
        """Copy the buffer `write` just filled to the device (on the current stream, not waited for)."""
        if self.stages.cuda:
            self.dev.copy_(self._stage, non_blocking=True)
        self.stages.copied()

    def expand(self, out: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """What the graph captures: one kernel expanding the device buffer into `out`."""
        from codegen.triton.step_metadata import expand_step_metadata

        return expand_step_metadata(self.dev, self.B, self.B, self.B * self.W, self.W, out=out, strided=True,
                                    feed=self.feed)
