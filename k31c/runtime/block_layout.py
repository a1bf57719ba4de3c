"""Packed hybrid block-cache layout (DESIGN §5 T1, T7; SPEC §7): the plan recorded in plan.json.

One cache block of B tokens (B a power of two) is ONE contiguous row of the cache pool. The row holds,
for every full-attention (MLA) layer in model order, that block's latent page and then its index-key
page (K3.1 Pro only). Pages have their own widths (no padding to a common size); each page starts at
a multiple of `alignment` bytes and the row is rounded up to a multiple of `alignment`:

    row = [ latent(l0) | pad | key(l0) | pad | latent(l1) | pad | key(l1) | ... | pad ]

Inside a page a token's data is one row per operand the kernels and the IR read (the cache pools of
`k31c.model.build` are [NB, B, *row] block views of these sections, `block_pool.BlockPool.layer_view`):
the latent page is ONE token-major section, the row the MLA kernels load as one unit-stride row of W
elements (for NVFP4 the codes, their block scales and k_pe side by side in that row); the key page
holds the index keys and then their scales as two sections (the indexer's `keys` and `key_scale`
operands), each a dense [B, width] array of one element type at a multiple of its element size, so an
f32 scale is never misaligned. Sections per format (kv = kv_lora_rank, r = qk_rope_head_dim,
d = index_head_dim), bytes per token from `k31c.plan.memory`:

    latent bf16 : latent  bf16  [B, kv+r]                                       2(kv+r) = 1152 B
    latent fp8  : latent  e4m3  [B, kv+r]   (per-layer scale held outside)       kv+r    =  576 B
    latent nvfp4: latent  u8    [B, kv/2 + kv/16 + r]: E2M1 codes of c_KV (two per byte, low nibble
                  even) | their E4M3 block scales (one per 16) | k_pe e4m3    kv/2+kv/16+r = 352 B
    key fp8     : keys    e4m3  [B, d]  | scales f32 [B]                         d+4     =  132 B
    key mxfp4   : keys    u8    [B, d/2] | scales u8 (E8M0) [B, d/32]            d/2+d/32 =  68 B

Bytes per token (logical, SPEC §7) = Σ_layers (latent + key) = 24·576 = 13,824 (K3, fp8),
24·708 = 16,992 (fp8 + fp8 keys), 24·420 = 10,080 (nvfp4 + mxfp4 keys). Physical bytes per token =
row_bytes / B = logical + padding / B; padding is 0 whenever every page size B·w is a multiple of the
alignment (k31-pro, 128-B alignment: all B ≥ 32), otherwise each page is rounded up to the alignment.

KDA state and conv tails live in a SEPARATE per-request slot pool (`StateLayout`), not in a block
row: state is per request (fixed size, independent of the context length) while rows are per token
block and all rows have one size. On k31-pro a request's state is 69 layers × (H·D·D·4 + (K−1)·3P·4)
≈ 465 MB at tp=1, ~430× a 64-token row (1.09 MB); folding it into rows would either inflate every row or
make rows unequal. A slot pool sized by `max_requests` keeps rows small and uniform, lets prefix-cache
checkpoints (T8) be plain slots, and matches T11 (rows and per-request state are transferred apart).
Inside the slot pool (one allocation of S = max_requests slots) the states are layer-major: KDA layer l's
states of all S slots form one contiguous [S, H, D, D] plane at byte S·state_offset(l), its conv tails
one [S, K−1, C] plane at S·conv_offset(l) (offsets of `StateLayout`, each a multiple of the alignment),
because the KDA kernels read a layer's state pool as one contiguous [S, H, D, D] array; a request's
state is then 2 per layer ranges at fixed strides (one strided copy for T11).

`plan_block_layout` plans from the model config and the compile-time formats (plan.json's
`cache_layout`); `layout_for_pools` lays out the same rows from a function's pool inputs as an engine
holds them (the reference interpreter widens bf16/f32 to its compute dtype), with the same placement
rules, so for the planned formats both give the same row byte for byte.
"""

from __future__ import annotations

import dataclasses

import torch

from ..model.config import ModelConfig
from ..plan.memory import kda_state_bytes, key_bytes_per_token, latent_bytes_per_token

LATENT_FORMATS = ("fp8", "nvfp4", "bf16")
KEY_FORMATS = ("fp8", "mxfp4")
STATE_FORMATS = ("f32", "bf16")

DTYPES = {"u8": torch.uint8, "e4m3": torch.float8_e4m3fn, "bf16": torch.bfloat16, "f16": torch.float16,
          "f32": torch.float32, "f64": torch.float64}
DTYPE_BYTES = {"u8": 1, "e4m3": 1, "bf16": 2, "f16": 2, "f32": 4, "f64": 8}
# IR pool input name prefix -> (page kind, section): `latent.{i}`, `index_keys.{i}`, `index_scales.{i}`
POOL_SECTIONS = {"latent": ("latent", "latent"), "index_keys": ("key", "keys"), "index_scales": ("key", "scales")}
# IR pool input name prefix -> per-request slot part: `kda_state.{i}` [S, H, D, D], `conv_state.{i}` [S, K-1, C]
SLOT_POOLS = ("kda_state", "conv_state")


class LayoutError(ValueError):
    """An impossible layout request (bad block size, format, alignment or model)."""


def _round_up(x: int, a: int) -> int:
    return -(-x // a) * a


def _is_pow2(x: int) -> bool:
    return isinstance(x, int) and x > 0 and x & (x - 1) == 0


@dataclasses.dataclass(frozen=True)
class Section:
    """One dense array of a page: `dtype` [B, width] (shape [B] when width is None) at `offset` bytes
    from the page start."""
    name: str
    dtype: str
    width: int | None
    offset: int

    def elems_per_token(self) -> int:
        return 1 if self.width is None else self.width

    def bytes_per_token(self) -> int:
        return self.elems_per_token() * DTYPE_BYTES[self.dtype]


@dataclasses.dataclass(frozen=True)
class Page:
    """The page of one full-attention layer and kind ("latent" or "key") inside a row."""
    layer: int  # model layer index (as in the `latent.{i}` pool names)
    kind: str
    fmt: str
    offset: int  # bytes from the row start
    nbytes: int  # B · bytes_per_token (+ section alignment, 0 for every supported format)
    bytes_per_token: int
    sections: tuple[Section, ...]

    def section(self, name: str) -> Section:
        for s in self.sections:
            if s.name == name:
                return s
        raise KeyError(f"{self.kind} page ({self.fmt}) of layer {self.layer} has no section {name!r}; "
                       f"sections: {[s.name for s in self.sections]}")


def _section_specs(cfg: ModelConfig, kind: str, fmt: str) -> list[tuple[str, str, int | None]]:
    kv, r, d = cfg.kv_lora_rank, cfg.qk_rope_head_dim, cfg.index_head_dim
    if kind == "latent":
        return {"bf16": [("latent", "bf16", kv + r)], "fp8": [("latent", "e4m3", kv + r)],
                "nvfp4": [("latent", "u8", kv // 2 + kv // 16 + r)]}[fmt]
    return {"fp8": [("keys", "e4m3", d), ("scales", "f32", None)],
            "mxfp4": [("keys", "u8", d // 2), ("scales", "u8", d // 32)]}[fmt]


def _place_sections(specs, block: int) -> tuple[tuple[Section, ...], int, int]:
    """Sections of one page from (name, dtype, width) specs in order, the page byte size and the largest
    element size (the page's own alignment)."""
    out, off, elem = [], 0, 1
    for name, dt, width in specs:
        es = DTYPE_BYTES[dt]
        off = _round_up(off, es)
        out.append(Section(name, dt, width, off))
        off += block * (1 if width is None else width) * es
        elem = max(elem, es)
    return tuple(out), off, elem


def _page_sections(cfg: ModelConfig, kind: str, fmt: str, block: int) -> tuple[tuple[Section, ...], int, int]:
    out, nbytes, elem = _place_sections(_section_specs(cfg, kind, fmt), block)
    per_token = sum(s.bytes_per_token() for s in out)
    expected = latent_bytes_per_token(cfg, fmt) if kind == "latent" else key_bytes_per_token(cfg, fmt)
    if per_token != expected:  # the section split must agree with the memory planner byte for byte
        raise LayoutError(f"{kind} {fmt}: sections hold {per_token} B/token but plan.memory says {expected}")
    return out, nbytes, elem


@dataclasses.dataclass(frozen=True)
class StateLayout:
    """One per-request KDA slot: for every KDA layer its recurrent state [H/tp, D, D] (f32|bf16) then its
    conv tail [K−1, 3P/tp] (f32), each at a multiple of `alignment`. In a pool of S slots the parts are
    layer-major planes (module docstring): slot s of layer l's state at S·state_offset + s·state_bytes."""
    layers: tuple[int, ...]
    heads: int  # per rank
    head_dim: int
    conv_shape: tuple[int, int]
    state_fmt: str
    state_offsets: tuple[int, ...]
    conv_offsets: tuple[int, ...]
    slot_bytes: int
    state_bytes_per_layer: int
    conv_bytes_per_layer: int
    conv_fmt: str = "f32"

    def offsets(self, layer: int) -> tuple[int, int]:
        if layer not in self.layers:
            raise KeyError(f"layer {layer} is not a KDA layer; KDA layers: {list(self.layers)}")
        j = self.layers.index(layer)
        return self.state_offsets[j], self.conv_offsets[j]


@dataclasses.dataclass(frozen=True)
class BlockLayout:
    """The plan of one cache row (see the module docstring) plus the KDA slot layout."""
    model: str
    block_size: int
    latent_fmt: str
    key_fmt: str | None  # None when the model has no indexer (K3)
    alignment: int
    pages: tuple[Page, ...]
    row_bytes: int
    state: StateLayout | None
    tp: int

    # ---- lookup ----------------------------------------------------------------------------------
    @property
    def layers(self) -> tuple[int, ...]:
        return tuple(dict.fromkeys(p.layer for p in self.pages))

    @property
    def kinds(self) -> tuple[str, ...]:
        return ("latent", "key") if self.key_fmt else ("latent",)

    def page(self, layer: int, kind: str) -> Page:
        for p in self.pages:
            if p.layer == layer and p.kind == kind:
                return p
        raise KeyError(f"no {kind!r} page for layer {layer}: full-attention layers {list(self.layers)}, "
                       f"kinds {list(self.kinds)}")

    def page_offsets(self, kind: str) -> tuple[int, ...]:
        """Byte offset within the row of `kind`'s page of each full-attention layer, in layer order."""
        return tuple(self.page(layer, kind).offset for layer in self.layers)

    # ---- byte accounting -------------------------------------------------------------------------
    @property
    def bytes_per_token_per_layer(self) -> dict:
        """Bytes per token of one full-attention layer (the same for every layer)."""
        lat = self.page(self.layers[0], "latent").bytes_per_token
        key = self.page(self.layers[0], "key").bytes_per_token if self.key_fmt else 0
        return {"latent": lat, "key": key, "total": lat + key}

    @property
    def bytes_per_token(self) -> int:
        """Logical cache bytes per token over all full-attention layers (SPEC §7, no padding)."""
        return sum(p.bytes_per_token for p in self.pages)

    @property
    def payload_bytes(self) -> int:
        return self.block_size * self.bytes_per_token

    @property
    def padding_bytes(self) -> int:
        return self.row_bytes - self.payload_bytes

    @property
    def row_bytes_per_token(self) -> float:
        """Physical bytes per token: row_bytes / B = bytes_per_token + padding_bytes / B."""
        return self.row_bytes / self.block_size

    def rows_for_bytes(self, budget: int) -> int:
        return max(budget, 0) // self.row_bytes

    def capacity_tokens(self, rows: int) -> int:
        return rows * self.block_size

    def blocks_for_tokens(self, tokens: int) -> int:
        return -(-tokens // self.block_size)

    def to_json(self) -> dict:
        """The `cache_layout` section of plan.json."""
        st = None
        if self.state is not None:
            s = self.state
            st = {"placement": "per-request slot pool (separate from block rows); layer-major planes: slot s of "
                               "layer l at S*offset(l) + s*bytes_per_layer in a pool of S slots",
                  "kda_layers": list(s.layers),
                  "heads_per_rank": s.heads, "head_dim": s.head_dim, "state_format": s.state_fmt,
                  "conv_format": s.conv_fmt,
                  "conv_shape": list(s.conv_shape), "state_bytes_per_layer": s.state_bytes_per_layer,
                  "conv_bytes_per_layer": s.conv_bytes_per_layer, "slot_bytes": s.slot_bytes,
                  "layers": [{"layer": l, "state_offset": so, "conv_offset": co}
                             for l, so, co in zip(s.layers, s.state_offsets, s.conv_offsets)]}
        return {
            "model": self.model, "block_size": self.block_size, "latent_format": self.latent_fmt,
            "key_format": self.key_fmt, "alignment": self.alignment, "tp": self.tp,
            "full_attention_layers": len(self.layers),
            "bytes_per_token_per_layer": self.bytes_per_token_per_layer,
            "bytes_per_token": self.bytes_per_token, "row_bytes": self.row_bytes,
            "payload_bytes_per_row": self.payload_bytes, "padding_bytes_per_row": self.padding_bytes,
            "row_bytes_per_token": self.row_bytes_per_token,
            "pages": [{"layer": p.layer, "kind": p.kind, "format": p.fmt, "offset": p.offset, "bytes": p.nbytes,
                       "bytes_per_token": p.bytes_per_token,
                       "sections": [{"name": s.name, "dtype": s.dtype, "width": s.width, "offset": s.offset}
                                    for s in p.sections]} for p in self.pages],
            "kda_state": st,
        }

    @staticmethod
    def from_json(d: dict) -> "BlockLayout":
        """The layout `to_json` wrote (plan.json's `cache_layout`, the `cache_layout` module attribute)."""
        try:
            st = d.get("kda_state")
            state = None if st is None else StateLayout(
                tuple(st["kda_layers"]), st["heads_per_rank"], st["head_dim"], tuple(st["conv_shape"]),
                st["state_format"], tuple(x["state_offset"] for x in st["layers"]),
                tuple(x["conv_offset"] for x in st["layers"]), st["slot_bytes"], st["state_bytes_per_layer"],
                st["conv_bytes_per_layer"], st["conv_format"])
            pages = tuple(Page(p["layer"], p["kind"], p["format"], p["offset"], p["bytes"], p["bytes_per_token"],
                               tuple(Section(s["name"], s["dtype"], s["width"], s["offset"]) for s in p["sections"]))
                          for p in d["pages"])
            return BlockLayout(d["model"], d["block_size"], d["latent_format"], d["key_format"], d["alignment"],
                               pages, d["row_bytes"], state, d["tp"])
        except (KeyError, TypeError) as e:
            raise LayoutError(f"cache_layout is not a layout this version reads ({type(e).__name__}: {e}); "
                              f"recompile the artifact") from e


def _place_state(layers, heads: int, d: int, conv_shape: tuple[int, int], state_fmt: str, conv_fmt: str,
                 alignment: int) -> StateLayout:
    state_b = heads * d * d * DTYPE_BYTES[state_fmt]
    conv_b = conv_shape[0] * conv_shape[1] * DTYPE_BYTES[conv_fmt]
    so, co, off = [], [], 0
    for _ in layers:
        so.append(off)
        off = _round_up(off + state_b, alignment)
        co.append(off)
        off = _round_up(off + conv_b, alignment)
    return StateLayout(tuple(layers), heads, d, tuple(conv_shape), state_fmt, tuple(so), tuple(co), off, state_b,
                       conv_b, conv_fmt)


def plan_state_layout(cfg: ModelConfig, tp: int, state_fmt: str, alignment: int) -> StateLayout | None:
    layers = cfg.kda_layers
    if not layers:
        return None
    if cfg.kda_num_heads % tp:
        raise LayoutError(f"KDA heads {cfg.kda_num_heads} not divisible by tp={tp}")
    mem = kda_state_bytes(cfg, tp, state_fmt)
    heads, d = cfg.kda_num_heads // tp, cfg.kda_head_dim
    st = _place_state(layers, heads, d, (cfg.conv_kernel_size - 1, 3 * heads * d), state_fmt, "f32", alignment)
    if len(layers) * (st.state_bytes_per_layer + st.conv_bytes_per_layer) != mem["per_request_per_rank"]:
        raise LayoutError(f"KDA slot {len(layers) * (st.state_bytes_per_layer + st.conv_bytes_per_layer)} B "
                          f"disagrees with plan.memory {mem['per_request_per_rank']} B")
    return st


def _place_pages(page_specs, block_size: int, alignment: int) -> tuple[tuple[Page, ...], int]:
    """Pages (layer, kind, fmt, sections specs) placed in order, each at a multiple of max(alignment, its
    largest element); returns the pages and the row size (rounded to the largest such alignment)."""
    pages, off, row_align = [], 0, alignment
    for layer, kind, fmt, sections, nbytes, elem in page_specs:
        a = max(alignment, elem)
        row_align = max(row_align, a)
        off = _round_up(off, a)
        pages.append(Page(layer, kind, fmt, off, nbytes, sum(s.bytes_per_token() for s in sections), sections))
        off += nbytes
    return tuple(pages), _round_up(off, row_align)


def plan_block_layout(cfg: ModelConfig, block_size: int = 64, latent_fmt: str = "fp8", key_fmt: str = "fp8",
                      alignment: int = 128, tp: int = 1, state_fmt: str = "f32") -> BlockLayout:
    """Plan one packed cache row for `cfg`. `key_fmt` is ignored (None) for models without an indexer.
    `alignment` (a power of two, bytes) applies to every page start and to the row size; a page is
    also aligned to its largest element size, so alignment=1 means "no padding" for every format here."""
    if not _is_pow2(block_size):
        raise LayoutError(f"block size must be a power of two (blocks pair across instances of different "
                          f"TP, DESIGN §5 T1), found {block_size!r}")
    if not _is_pow2(alignment):
        raise LayoutError(f"alignment must be a power of two number of bytes, found {alignment!r}")
    if latent_fmt not in LATENT_FORMATS:
        raise LayoutError(f"latent cache format must be one of {LATENT_FORMATS}, found {latent_fmt!r}")
    if state_fmt not in STATE_FORMATS:
        raise LayoutError(f"KDA state format must be one of {STATE_FORMATS}, found {state_fmt!r}")
    if not cfg.full_attn_layers:
        raise LayoutError(f"model {cfg.name} has no full-attention layer: there is nothing to page")
    if cfg.has_indexer:
        if key_fmt not in KEY_FORMATS:
            raise LayoutError(f"index-key cache format must be one of {KEY_FORMATS}, found {key_fmt!r}")
        if key_fmt == "mxfp4" and cfg.index_head_dim % 32:
            raise LayoutError(f"MXFP4 index keys need index_head_dim divisible by 32, found {cfg.index_head_dim}")
    if latent_fmt == "nvfp4" and cfg.kv_lora_rank % 16:
        raise LayoutError(f"NVFP4 latents need kv_lora_rank divisible by 16, found {cfg.kv_lora_rank}")
    kinds = [("latent", latent_fmt)] + ([("key", key_fmt)] if cfg.has_indexer else [])
    specs = [(layer, kind, fmt, *_page_sections(cfg, kind, fmt, block_size))
             for layer in sorted(cfg.full_attn_layers) for kind, fmt in kinds]
    pages, row_bytes = _place_pages(specs, block_size, alignment)
    state = plan_state_layout(cfg, tp, state_fmt, max(alignment, 4))
    return BlockLayout(cfg.name, block_size, latent_fmt, key_fmt if cfg.has_indexer else None, alignment,
                       pages, row_bytes, state, tp)


_FORMAT_OF = {("latent", "e4m3"): "fp8", ("latent", "u8"): "nvfp4", ("key", "e4m3"): "fp8", ("key", "u8"): "mxfp4"}


def layout_for_pools(model: str, block_size: int, block_pools, slot_pools=(), alignment: int = 128,
                     tp: int = 1) -> BlockLayout:
    """The packed row for a function's pool inputs as an engine holds them.

    block_pools: (name, dtype, row shape) of every block pool input (`latent.{i}` [*row] = [W],
    `index_keys.{i}` [W], `index_scales.{i}` [] or [W]; dtype a key of DTYPES), placed exactly as
    `plan_block_layout` places the planned formats (layer order, latent page then key page, sections in
    the order keys, scales). slot_pools: (name, dtype, shape after S) of `kda_state.{i}` [H, D, D] and
    `conv_state.{i}` [K-1, C]. A page's format is the planned format name when its dtype is one
    (e4m3 -> fp8, u8 -> nvfp4 / mxfp4), else the dtype (e.g. a bf16 latent held in f32 by the interpreter)."""
    if not _is_pow2(block_size):
        raise LayoutError(f"block size must be a power of two, found {block_size!r}")
    by_page: dict[tuple[int, str], dict[str, tuple[str, int | None]]] = {}
    for name, dt, row in block_pools:
        prefix, _, layer = name.rpartition(".")
        if prefix not in POOL_SECTIONS or not layer.isdigit():
            raise LayoutError(f"pool input {name!r} is not a block pool this layout knows ({list(POOL_SECTIONS)} "
                              f"followed by .<layer>)")
        if dt not in DTYPES or len(row) > 1:
            raise LayoutError(f"pool input {name!r}: {dt}{list(row)} rows (dtype one of {list(DTYPES)}, rank <= 1)")
        kind, sec = POOL_SECTIONS[prefix]
        by_page.setdefault((int(layer), kind), {})[sec] = (dt, int(row[0]) if row else None)
    if not by_page:
        raise LayoutError(f"model {model}: no block pool input to lay out")
    specs, fmts = [], {}
    for (layer, kind) in sorted(by_page, key=lambda lk: (lk[0], lk[1] != "latent")):
        secs = by_page[(layer, kind)]
        order = ["latent"] if kind == "latent" else ["keys", "scales"]
        if sorted(secs) != sorted(order):
            raise LayoutError(f"layer {layer} {kind} page: pools give sections {sorted(secs)}, expected {order}")
        fmt = fmts.setdefault(kind, _FORMAT_OF.get((kind, secs[order[0]][0]), secs[order[0]][0]))
        specs.append((layer, kind, fmt, *_place_sections([(n, *secs[n]) for n in order], block_size)))
    pages, row_bytes = _place_pages(specs, block_size, alignment)
    state, slots = None, {}
    for name, dt, shape in slot_pools:
        prefix, _, layer = name.rpartition(".")
        if prefix not in SLOT_POOLS or not layer.isdigit() or dt not in DTYPES:
            raise LayoutError(f"slot pool input {name!r} ({dt}) is not a KDA state / conv pool this layout knows")
        slots.setdefault(int(layer), {})[prefix] = (dt, tuple(int(d) for d in shape))
    if slots:
        layers = sorted(slots)
        first = slots[layers[0]]
        ok = all(v == first for v in slots.values()) and sorted(first) == sorted(SLOT_POOLS) and \
            len(first["kda_state"][1]) == 3 and first["kda_state"][1][1] == first["kda_state"][1][2] and \
            len(first["conv_state"][1]) == 2
        if not ok:
            raise LayoutError(f"KDA slot pools must give every layer one kda_state [H, D, D] and one conv_state "
                              f"[K-1, C] of the same shapes, found {slots}")
        (sdt, (h, d, _)), (cdt, conv) = first["kda_state"], first["conv_state"]
        state = _place_state(layers, h, d, conv, sdt, cdt, max(alignment, 4))
    return BlockLayout(model, block_size, fmts["latent"], fmts.get("key"), alignment, pages, row_bytes, state, tp)
