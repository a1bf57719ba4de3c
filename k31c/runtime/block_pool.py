"""The packed block-cache pool (DESIGN §5 T1): one uint8 allocation of N rows laid out by a
`BlockLayout`, a free list of rows, per-request block lists and KDA state slots, and the per-step
translation of block tables into the addresses kernels read.

Addressing. A request's token at position p lives in block j = p >> log2(B) of its block table, at
slot s = p & (B−1) of that block. With row = block_table[req, j]:

    page address      = row · row_bytes + page.offset                       (one per block, per layer)
    token entry of a section = page address + section.offset + s · section_bytes_per_token

`page_addresses` produces the first for all layers at once ([L, R, W] int64, −1 where a request holds no
block); `slot_rows` produces (row, s) per token once per step; `layer_view` gives each section of a
layer's pages as a typed [N, B, width] view of the pool (no copy), so a kernel or torch code indexes
`view[row, s]` with the step's (row, s) for every layer. These views are the IR's block-view pool
operands ([NB, bs, *row], `ir.ref.paging`): `pool_view(name)` gives the view of an IR pool input by name.

KDA state lives in a separate slot pool (see `block_layout`): `states` is one uint8 allocation of
`max_requests` slots in layer-major planes (each layer's [S, H, D, D] states contiguous, as the KDA
kernels read them); a request takes one slot on its first allocation and returns it with its blocks.
Blocks are reference-counted (`blocks.BlockAllocator`, `allocator`) so a cached prefix can be shared.
"""

from __future__ import annotations

import torch

from .block_layout import DTYPES, DTYPE_BYTES, POOL_SECTIONS, SLOT_POOLS, BlockLayout, Page, Section
from .blocks import BlockAllocator


class PoolExhausted(RuntimeError):
    """Not enough free blocks (or state slots) for a request; the pool is left unchanged."""

    def __init__(self, message: str, request, needed: int, free: int):
        super().__init__(message)
        self.request, self.needed, self.free = request, needed, free


class BlockPool:
    def __init__(self, layout: BlockLayout, num_blocks: int, max_requests: int = 0, device="cpu"):
        if num_blocks <= 0:
            raise ValueError(f"a block pool needs at least one block, asked for {num_blocks}")
        if max_requests < 0:
            raise ValueError(f"max_requests must be >= 0, found {max_requests}")
        self.layout, self.num_blocks, self.device = layout, num_blocks, torch.device(device)
        self.block_size = layout.block_size
        self.block_shift = layout.block_size.bit_length() - 1
        self.rows = torch.zeros(num_blocks, layout.row_bytes, dtype=torch.uint8, device=self.device)
        st = layout.state
        self.states = (torch.zeros(max_requests, st.slot_bytes, dtype=torch.uint8, device=self.device)
                       if st is not None and max_requests > 0 else None)
        self.max_requests = max_requests
        self.allocator = BlockAllocator(num_blocks)  # lowest free row handed out first
        self._free_slots = list(range(max_requests - 1, -1, -1))
        self._blocks: dict[object, list[int]] = {}
        self._slots: dict[object, int] = {}

    # ---- allocation ------------------------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        return self.allocator.num_free

    @property
    def num_free_slots(self) -> int:
        return len(self._free_slots)

    @property
    def requests(self) -> tuple:
        return tuple(self._blocks)

    def blocks_of(self, request) -> list[int]:
        return list(self._blocks_or_raise(request))

    def state_slot(self, request) -> int:
        self._blocks_or_raise(request)
        if request not in self._slots:
            raise KeyError(f"request {request!r} has no KDA state slot (pool built with max_requests=0 "
                           f"or the model has no KDA layer)")
        return self._slots[request]

    def allocate(self, request, num_tokens: int) -> list[int]:
        """Make `request` hold enough blocks for `num_tokens` tokens (growing its list; never shrinking)
        and, on its first allocation, a KDA state slot. Returns the request's whole block list.
        Raises PoolExhausted, changing nothing, when the blocks or the slot are not there."""
        if num_tokens < 0:
            raise ValueError(f"request {request!r}: token count must be >= 0, found {num_tokens}")
        have = self._blocks.get(request, [])
        need = max(0, self.layout.blocks_for_tokens(num_tokens) - len(have))
        if need > self.num_free_blocks:
            raise PoolExhausted(
                f"request {request!r} needs {need} more block(s) for {num_tokens} tokens "
                f"({self.block_size} tokens per block, holds {len(have)}) but only "
                f"{self.num_free_blocks} of {self.num_blocks} blocks are free", request, need,
                self.num_free_blocks)
        new_request = request not in self._blocks
        wants_slot = new_request and self.states is not None
        if wants_slot and not self._free_slots:
            raise PoolExhausted(f"request {request!r} needs a KDA state slot but all {self.max_requests} "
                                f"slots are taken", request, 1, 0)
        blocks = self._blocks.setdefault(request, [])
        blocks.extend(self.allocator.allocate(need))
        if wants_slot:
            self._slots[request] = self._free_slots.pop()
        return list(blocks)

    def free(self, request) -> None:
        """Return all of `request`'s blocks and its state slot to the free lists."""
        blocks = self._blocks_or_raise(request)
        self.allocator.release(blocks)
        del self._blocks[request]
        if request in self._slots:
            self._free_slots.append(self._slots.pop(request))

    def _blocks_or_raise(self, request) -> list[int]:
        if request not in self._blocks:
            raise KeyError(f"request {request!r} holds no blocks in this pool "
                           f"({len(self._blocks)} requests allocated)")
        return self._blocks[request]

    # ---- per-step translation --------------------------------------------------------------------
    def block_table(self, requests, width: int | None = None) -> torch.Tensor:
        """int64 [R, W] of the requests' rows, padded with −1 (W = the longest list unless given)."""
        lists = [self._blocks_or_raise(r) for r in requests]
        longest = max((len(b) for b in lists), default=0)
        width = longest if width is None else width
        if width < longest:
            raise ValueError(f"block table width {width} is smaller than the longest block list ({longest})")
        table = torch.full((len(lists), width), -1, dtype=torch.int64)
        for i, b in enumerate(lists):
            table[i, :len(b)] = torch.tensor(b, dtype=torch.int64)
        return table.to(self.device)

    def slot_rows(self, block_table: torch.Tensor, token_req: torch.Tensor, token_pos: torch.Tensor):
        """(row, slot) int64 [T] of every token: row = block_table[req, pos >> log2 B], slot = pos & (B−1).
        `token_req` indexes the rows of `block_table`. Raises IndexError naming the first bad token."""
        token_req, token_pos = token_req.to(torch.int64), token_pos.to(torch.int64)
        col = token_pos >> self.block_shift
        width = block_table.shape[1]
        bad = (token_pos < 0) | (col >= width) | (token_req < 0) | (token_req >= block_table.shape[0])
        if bool(bad.any()):
            t = int(bad.nonzero()[0, 0])
            raise IndexError(f"token {t} (request row {int(token_req[t])}, position {int(token_pos[t])}) is outside "
                             f"the block table [{block_table.shape[0]} requests, {width} blocks of "
                             f"{self.block_size}]")
        rows = block_table[token_req, col]
        if bool((rows < 0).any()):
            t = int((rows < 0).nonzero()[0, 0])
            raise IndexError(f"token {t} (request row {int(token_req[t])}, position {int(token_pos[t])}) falls in "
                             f"block {int(col[t])}, which the request does not hold")
        return rows, token_pos & (self.block_size - 1)

    def page_addresses(self, block_table: torch.Tensor, layer: int | None = None, kind: str = "latent"):
        """Byte address in the pool of `kind`'s page of every block in the table: [R, W] for one layer,
        [L, R, W] (full-attention layers in order) when `layer` is None; −1 where no block is held."""
        if layer is None:
            offs = torch.tensor(self.layout.page_offsets(kind), dtype=torch.int64, device=block_table.device)
        else:
            offs = torch.tensor([self.layout.page(layer, kind).offset], dtype=torch.int64, device=block_table.device)
        addr = block_table.unsqueeze(0) * self.layout.row_bytes + offs.view(-1, 1, 1)
        addr = torch.where(block_table.unsqueeze(0) >= 0, addr, torch.full_like(addr, -1))
        return addr if layer is None else addr[0]

    def token_addresses(self, rows: torch.Tensor, slots: torch.Tensor, layer: int, kind: str, section: str):
        """Byte address of each token's entry in one section of one layer's page."""
        page = self.layout.page(layer, kind)
        sec = page.section(section)
        return rows * self.layout.row_bytes + page.offset + sec.offset + slots * sec.bytes_per_token()

    # ---- typed views (no copies) -----------------------------------------------------------------
    def _typed(self, base: torch.Tensor, dtype: str, byte_offset: int, size, byte_strides):
        es = DTYPE_BYTES[dtype]
        assert byte_offset % es == 0 and all(s % es == 0 for s in byte_strides), "layout alignment broken"
        flat = base.view(-1).view(DTYPES[dtype])
        return flat.as_strided(size, [s // es for s in byte_strides], byte_offset // es)

    def layer_view(self, layer: int, kind: str, section: str | None = None) -> torch.Tensor:
        """One section of `layer`'s `kind` pages over every row: [N, B, width] (or [N, B] for a per-token
        scalar such as the fp8 key scale), typed, aliasing the pool. `section` may be omitted when the
        page has only one (fp8 / bf16 latent)."""
        page = self.layout.page(layer, kind)
        sec = _pick_section(page, section)
        rb, per_tok = self.layout.row_bytes, sec.bytes_per_token()
        off = page.offset + sec.offset
        if sec.width is None:
            return self._typed(self.rows, sec.dtype, off, (self.num_blocks, self.block_size), (rb, per_tok))
        es = DTYPE_BYTES[sec.dtype]
        return self._typed(self.rows, sec.dtype, off, (self.num_blocks, self.block_size, sec.width), (rb, per_tok, es))

    def page_view(self, row: int, layer: int, kind: str) -> dict[str, torch.Tensor]:
        """Every section of one page as typed [B, width] views, e.g. the fp8 latent page as
        float8_e4m3fn [B, 576]."""
        if not 0 <= row < self.num_blocks:
            raise IndexError(f"row {row} outside the pool of {self.num_blocks} rows")
        page = self.layout.page(layer, kind)
        return {s.name: self.layer_view(layer, kind, s.name)[row] for s in page.sections}

    def state_view(self, layer: int, slot: int | None = None):
        """(state, conv) of KDA `layer` as typed contiguous views: [S, H, D, D] and [S, K−1, C] over all
        slots (the `kda_state.{i}` / `conv_state.{i}` pool inputs), or one slot's when `slot` is given."""
        if self.states is None:
            raise KeyError("this pool holds no KDA state slots (max_requests=0 or no KDA layer)")
        st, n = self.layout.state, self.max_requests
        s_off, c_off = st.offsets(layer)
        h, d = st.heads, st.head_dim
        es = DTYPE_BYTES[st.state_fmt]
        state = self._typed(self.states, st.state_fmt, n * s_off, (n, h, d, d), (h * d * d * es, d * d * es, d * es, es))
        k1, c = st.conv_shape
        ce = DTYPE_BYTES[st.conv_fmt]
        conv = self._typed(self.states, st.conv_fmt, n * c_off, (n, k1, c), (k1 * c * ce, c * ce, ce))
        return (state, conv) if slot is None else (state[slot], conv[slot])

    def pool_view(self, name: str) -> torch.Tensor:
        """The view an IR pool input `name` is given: `latent.{i}` / `index_keys.{i}` / `index_scales.{i}`
        as [N, B, *row] block views of the rows, `kda_state.{i}` / `conv_state.{i}` as [S, ...] slot views."""
        prefix, _, layer = name.rpartition(".")
        if prefix in POOL_SECTIONS and layer.isdigit():
            kind, section = POOL_SECTIONS[prefix]
            return self.layer_view(int(layer), kind, section)
        if prefix in SLOT_POOLS and layer.isdigit():
            return self.state_view(int(layer))[SLOT_POOLS.index(prefix)]
        raise KeyError(f"{name!r} is not a pool input of this layout ({list(POOL_SECTIONS)} or {list(SLOT_POOLS)} "
                       f"followed by .<layer>)")


def _pick_section(page: Page, section: str | None) -> Section:
    if section is not None:
        return page.section(section)
    if len(page.sections) != 1:
        raise KeyError(f"{page.kind} page ({page.fmt}) of layer {page.layer} has sections "
                       f"{[s.name for s in page.sections]}: name one")
    return page.sections[0]
