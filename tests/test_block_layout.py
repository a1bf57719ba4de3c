"""Packed block-row layout (DESIGN §5 T1, T7; SPEC §7): page placement properties and byte accounting."""

from __future__ import annotations

import itertools
import json

import pytest

from k31c.model.presets import get_preset
from k31c.plan.memory import cache_bytes, kda_state_bytes
from k31c.runtime.block_layout import DTYPE_BYTES, LayoutError, plan_block_layout

K31, K3 = get_preset("k31-pro"), get_preset("k3-pro")
TINY, K3_TINY = get_preset("k31-tiny"), get_preset("k3-tiny")
FORMATS = list(itertools.product(("fp8", "nvfp4", "bf16"), ("fp8", "mxfp4")))


def _check_layout(lay):
    B, pages = lay.block_size, sorted(lay.pages, key=lambda p: p.offset)
    assert len(pages) == len(lay.layers) * len(lay.kinds)
    for p in pages:
        assert 0 <= p.offset and p.offset + p.nbytes <= lay.row_bytes, f"page {p} outside its row"
        elem = max(DTYPE_BYTES[s.dtype] for s in p.sections)
        assert p.offset % max(lay.alignment, elem) == 0, f"page {p.layer}/{p.kind} misaligned"
        assert p.nbytes == B * p.bytes_per_token
        secs = sorted(p.sections, key=lambda s: s.offset)
        for s in secs:
            assert s.offset % DTYPE_BYTES[s.dtype] == 0
            assert s.offset + B * s.bytes_per_token() <= p.nbytes
        for a, b in zip(secs, secs[1:]):
            assert a.offset + B * a.bytes_per_token() <= b.offset, "sections overlap"
    for a, b in zip(pages, pages[1:]):
        assert a.offset + a.nbytes <= b.offset, f"pages {a.layer}/{a.kind} and {b.layer}/{b.kind} overlap"
    assert lay.row_bytes % lay.alignment == 0
    assert lay.row_bytes == sum(p.nbytes for p in pages) + lay.padding_bytes
    assert lay.padding_bytes >= 0
    gaps = pages[0].offset + sum(b.offset - a.offset - a.nbytes for a, b in zip(pages, pages[1:])) \
        + lay.row_bytes - pages[-1].offset - pages[-1].nbytes
    assert gaps == lay.padding_bytes
    # every padding gap is shorter than the alignment that caused it
    assert all(b.offset - a.offset - a.nbytes < max(lay.alignment, 4) for a, b in zip(pages, pages[1:]))


@pytest.mark.parametrize("cfg", [K31, K3, TINY, K3_TINY], ids=lambda c: c.name)
@pytest.mark.parametrize("latent,key", FORMATS)
@pytest.mark.parametrize("block", [1, 16, 64, 256])
@pytest.mark.parametrize("align", [1, 128, 512])
def test_layout_properties(cfg, latent, key, block, align):
    lay = plan_block_layout(cfg, block, latent, key, align)
    _check_layout(lay)
    per_layer = cache_bytes(cfg, latent, key)
    assert lay.bytes_per_token == per_layer["per_token"]
    assert lay.bytes_per_token_per_layer["total"] == per_layer["per_layer"]
    assert lay.layers == tuple(sorted(cfg.full_attn_layers))
    # capacity arithmetic: rows × block size tokens
    budget = 1000 * lay.row_bytes + lay.row_bytes - 1
    rows = lay.rows_for_bytes(budget)
    assert rows == 1000 and lay.capacity_tokens(rows) == 1000 * block
    assert lay.blocks_for_tokens(block * 3 + 1) == 4 and lay.blocks_for_tokens(0) == 0
    assert lay.row_bytes_per_token == lay.bytes_per_token + lay.padding_bytes / block
    json.dumps(lay.to_json())


@pytest.mark.parametrize("latent,key,expected", [("fp8", "fp8", 16992), ("nvfp4", "mxfp4", 10080),
                                                 ("fp8", "mxfp4", 24 * (576 + 68)),
                                                 ("nvfp4", "fp8", 24 * (352 + 132))])
def test_spec7_bytes_per_token_k31_pro(latent, key, expected):
    for block in (1, 2, 64, 1024):
        lay = plan_block_layout(K31, block, latent, key, alignment=1)
        assert lay.bytes_per_token == expected
        assert lay.padding_bytes == 0 and lay.row_bytes == block * expected
    lay = plan_block_layout(K31, 64, latent, key, alignment=128)  # every 64-token page is a multiple of 128 B
    assert lay.padding_bytes == 0 and lay.row_bytes == 64 * expected
    assert lay.to_json()["bytes_per_token"] == expected


def test_spec7_k3_has_no_keys():
    lay = plan_block_layout(K3, 64, "fp8", "mxfp4", alignment=128)
    assert lay.bytes_per_token == 13824 and lay.key_fmt is None and lay.kinds == ("latent",)
    assert lay.row_bytes == 64 * 13824 and lay.bytes_per_token_per_layer == {"latent": 576, "key": 0, "total": 576}


def test_alignment_padding_small_blocks():
    """With 128-B alignment a 16-token fp8 key page (2112 B) rounds up to 2176 B: 64 B per layer."""
    lay = plan_block_layout(K31, 16, "fp8", "fp8", alignment=128)
    assert lay.padding_bytes == 24 * 64
    assert lay.row_bytes_per_token == 16992 + 24 * 64 / 16
    assert lay.bytes_per_token == 16992  # logical bytes never include padding


def test_kda_state_slot_layout():
    for tp in (1, 4):
        lay = plan_block_layout(K31, 64, "fp8", "fp8", 128, tp=tp)
        st = lay.state
        mem = kda_state_bytes(K31, tp)
        assert len(st.layers) == 69 and st.slot_bytes == mem["per_request_per_rank"]  # 128 | every part
        spans = sorted([(o, st.state_bytes_per_layer) for o in st.state_offsets]
                       + [(o, st.conv_bytes_per_layer) for o in st.conv_offsets])
        for (a, n), (b, _) in zip(spans, spans[1:]):
            assert a % 128 == 0 and a + n <= b
        assert spans[-1][0] + spans[-1][1] <= st.slot_bytes
    assert plan_block_layout(K31, 64, state_fmt="bf16").state.state_bytes_per_layer == 96 * 128 * 128 * 2
    js = plan_block_layout(TINY, 4, alignment=16).to_json()["kda_state"]
    assert js["placement"].startswith("per-request slot pool") and len(js["layers"]) == 6


def test_bad_inputs():
    for block in (0, 3, 48, -8, 2.0):
        with pytest.raises(LayoutError, match="power of two"):
            plan_block_layout(K31, block)
    with pytest.raises(LayoutError, match="alignment"):
        plan_block_layout(K31, 64, alignment=96)
    with pytest.raises(LayoutError, match="latent cache format"):
        plan_block_layout(K31, 64, latent_fmt="fp4")
    with pytest.raises(LayoutError, match="index-key cache format"):
        plan_block_layout(K31, 64, key_fmt="nvfp4")
    with pytest.raises(LayoutError, match="divisible by 32"):
        plan_block_layout(K31.replace(index_head_dim=16), 64, key_fmt="mxfp4")
    with pytest.raises(LayoutError, match="not divisible by tp"):
        plan_block_layout(K31, 64, tp=5)


IR_LATENT = {"fp8": "f8e4m3", "nvfp4": "nvfp4", "bf16": "bf16"}
IR_TO_LAYOUT = {"f8e4m3": "e4m3", "u8": "u8", "bf16": "bf16", "f32": "f32"}


def _pool_specs(cfg, block, latent, key):
    """(block pools, slot pools) of the model's pool inputs (`k31c.model.build.pool_inputs`) as the
    runtime passes them to `layout_for_pools`."""
    from k31c.model.build import BuildOptions, pool_inputs

    blocks, slots = [], []
    for name, dt, dims in pool_inputs(cfg, BuildOptions(block_size=block, latent_cache_dtype=IR_LATENT[latent],
                                                        key_cache=key)):
        if dims[0] == "NB":
            assert dims[1] == block
            blocks.append((name, IR_TO_LAYOUT[dt], tuple(dims[2:])))
        else:
            slots.append((name, IR_TO_LAYOUT[dt], tuple(dims[1:])))
    return blocks, slots


@pytest.mark.parametrize("cfg", [K31, K3, TINY, K3_TINY], ids=lambda c: c.name)
@pytest.mark.parametrize("latent,key", FORMATS)
@pytest.mark.parametrize("block", [1, 16, 64])
def test_runtime_layout_from_pool_inputs_is_the_plan(cfg, latent, key, block):
    """The IR's pool inputs (block views [NB, bs, *row] and KDA slots) laid out by `layout_for_pools` are
    plan.json's layout byte for byte: every page section is one pool operand as the IR reads it."""
    from k31c.runtime.block_layout import layout_for_pools

    blocks, slots = _pool_specs(cfg, block, latent, key)
    lay = layout_for_pools(cfg.name, block, blocks, slots)
    assert lay == plan_block_layout(cfg, block, latent, key)
    for p in lay.pages:  # the latent page is one token-major row; the key page the indexer's two operands
        assert [s.name for s in p.sections] == (["latent"] if p.kind == "latent" else ["keys", "scales"])


def test_nvfp4_latent_is_one_token_major_row():
    lay = plan_block_layout(K31, 64, "nvfp4", "mxfp4")
    (sec,) = lay.page(lay.layers[0], "latent").sections
    assert (sec.dtype, sec.width, sec.offset) == ("u8", 512 // 2 + 512 // 16 + 64, 0) and sec.bytes_per_token() == 352
    keys, scales = lay.page(lay.layers[0], "key").sections
    assert (keys.dtype, keys.width, scales.dtype, scales.width, scales.offset) == ("u8", 64, "u8", 4, 64 * 64)


def test_layout_for_pools_errors():
    from k31c.runtime.block_layout import layout_for_pools

    blocks, slots = _pool_specs(TINY, 16, "fp8", "fp8")
    with pytest.raises(LayoutError, match="'weird.3' is not a block pool"):
        layout_for_pools("m", 16, blocks + [("weird.3", "u8", (4,))], slots)
    with pytest.raises(LayoutError, match="key page: pools give sections"):
        layout_for_pools("m", 16, [b for b in blocks if not b[0].startswith("index_scales")], slots)
    with pytest.raises(LayoutError, match="power of two"):
        layout_for_pools("m", 12, blocks, slots)
    with pytest.raises(LayoutError, match="KDA slot pools"):
        layout_for_pools("m", 16, blocks, [s for s in slots if not s[0].startswith("conv_state")])
    # a widened pool (the interpreter holds a bf16 latent in f32) is laid out in what the engine holds
    wide = layout_for_pools("m", 16, [(n, "f32" if n.startswith("latent") else d, r) for n, d, r in blocks], slots)
    assert wide.latent_fmt == "f32" and wide.page(wide.layers[0], "latent").bytes_per_token == 4 * TINY.latent_cache_dim
    _check_layout(wide)
