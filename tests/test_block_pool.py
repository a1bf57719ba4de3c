"""Block pool (DESIGN §5 T1): allocation without leaks, block-table translation, typed views aliasing
the pool bytes, clear errors."""

from __future__ import annotations

import random

import pytest
import torch

from k31c.model.presets import get_preset
from k31c.runtime.block_layout import LayoutError, plan_block_layout
from k31c.runtime.block_pool import BlockPool, PoolExhausted

TINY = get_preset("k31-tiny")


def _pool(latent="fp8", key="fp8", block=8, blocks=64, requests=8, cfg=TINY, align=128):
    return BlockPool(plan_block_layout(cfg, block, latent, key, align), blocks, max_requests=requests)


def _bytes(x: torch.Tensor) -> torch.Tensor:
    return x.reshape(-1).view(torch.uint8)


def test_random_allocate_free_no_leaks():
    rng = random.Random(0)
    pool = _pool(blocks=50, requests=6)
    live: dict[int, int] = {}
    exhausted = 0
    for step in range(2000):
        if live and (rng.random() < 0.4 or len(live) == 6):
            rid = rng.choice(sorted(live))
            pool.free(rid)
            del live[rid]
        else:
            rid = step if not live or rng.random() < 0.5 else rng.choice(sorted(live))
            tokens = live.get(rid, 0) + rng.randint(0, 60)
            before = (pool.num_free_blocks, pool.num_free_slots, {r: pool.blocks_of(r) for r in live})
            try:
                blocks = pool.allocate(rid, tokens)
                live[rid] = tokens
                assert len(blocks) == -(-tokens // 8)
            except PoolExhausted as e:
                exhausted += 1
                assert e.needed > e.free and e.request == rid
                assert before == (pool.num_free_blocks, pool.num_free_slots, {r: pool.blocks_of(r) for r in live})
        held = [b for r in live for b in pool.blocks_of(r)]
        assert len(held) == len(set(held)) and len(held) + pool.num_free_blocks == 50
        slots = [pool.state_slot(r) for r in live]
        assert len(slots) == len(set(slots)) and len(slots) + pool.num_free_slots == 6
    assert exhausted > 0  # the pool was too small at times
    for rid in list(live):
        pool.free(rid)
    assert pool.num_free_blocks == 50 and pool.num_free_slots == 6 and pool.requests == ()


@pytest.mark.parametrize("latent,key", [("fp8", "fp8"), ("nvfp4", "mxfp4"), ("bf16", "mxfp4"), ("nvfp4", "fp8")])
def test_block_table_translation_round_trip(latent, key):
    g = torch.Generator().manual_seed(1)
    pool = _pool(latent, key, block=4, blocks=40, requests=5)
    lengths = [13, 1, 30, 7, 22]
    for r, n in enumerate(lengths):
        pool.allocate(f"req{r}", n)
    reqs = [f"req{r}" for r in range(5)]
    table = pool.block_table(reqs)
    assert table.shape == (5, 8) and int((table >= 0).sum()) == sum(-(-n // 4) for n in lengths)
    token_req = torch.cat([torch.full((n,), r) for r, n in enumerate(lengths)])
    token_pos = torch.cat([torch.arange(n) for n in lengths])
    perm = torch.randperm(len(token_req), generator=g)
    token_req, token_pos = token_req[perm], token_pos[perm]
    rows, slots = pool.slot_rows(table, token_req, token_pos)
    assert len(set(zip(rows.tolist(), slots.tolist()))) == len(rows)  # no two tokens share an entry
    lay, flat = pool.layout, pool.rows.view(-1)
    all_addr = pool.page_addresses(table, None, "latent")
    assert all_addr.shape == (len(lay.layers), 5, 8)
    for li, layer in enumerate(lay.layers):
        for kind in lay.kinds:
            page_addr = pool.page_addresses(table, layer, kind)
            assert torch.equal(page_addr[table < 0], torch.full_like(page_addr[table < 0], -1))
            if kind == "latent":
                assert torch.equal(page_addr, all_addr[li])
            for sec in lay.page(layer, kind).sections:
                view = pool.layer_view(layer, kind, sec.name)
                shape = (len(rows),) + tuple(view.shape[2:])
                vals = torch.randint(1, 100, shape, generator=g, dtype=torch.int32)
                typed = vals.to(view.dtype)
                view[rows, slots] = typed
                # read back (a) through the page view of each token's row
                for t in range(0, len(rows), 5):
                    page = pool.page_view(int(rows[t]), layer, kind)[sec.name]
                    assert torch.equal(_bytes(page[int(slots[t])]), _bytes(typed[t]))
                # (b) as raw bytes at the translated byte address
                addr = pool.token_addresses(rows, slots, layer, kind, sec.name)
                blk = table[token_req, token_pos // 4]
                assert torch.equal(addr, page_addr[token_req, token_pos // 4] + sec.offset
                                   + (token_pos % 4) * sec.bytes_per_token())
                assert torch.equal(blk, rows)
                nb = sec.bytes_per_token()
                got = flat[addr.unsqueeze(1) + torch.arange(nb)]
                assert torch.equal(got.reshape(-1), _bytes(typed))


def test_typed_views_alias_pool():
    pool = _pool("fp8", "fp8", block=8, blocks=4)
    layer = pool.layout.layers[1]
    page = pool.page_view(2, layer, "latent")["latent"]
    assert page.dtype == torch.float8_e4m3fn and page.shape == (8, TINY.latent_cache_dim)
    assert page.untyped_storage().data_ptr() == pool.rows.untyped_storage().data_ptr()
    before = pool.rows.clone()
    page[3, 5] = 1.5
    changed = (pool.rows != before).nonzero()
    off = pool.layout.page(layer, "latent").offset + 3 * TINY.latent_cache_dim + 5
    assert changed.tolist() == [[2, off]]
    assert pool.rows[2, off].item() == torch.tensor(1.5, dtype=torch.float8_e4m3fn).view(torch.uint8).item()
    scale = pool.page_view(1, layer, "key")["scales"]
    assert scale.dtype == torch.float32 and scale.shape == (8,)
    scale[7] = 3.25
    key_page = pool.layout.page(layer, "key")
    s_off = key_page.offset + key_page.section("scales").offset + 7 * 4
    assert pool.rows[1, s_off:s_off + 4].view(torch.float32).item() == 3.25
    # KDA state slots: views alias the slot pool and have today's pool shapes
    pool.allocate("a", 1)
    kda = TINY.kda_layers[2]
    state, conv = pool.state_view(kda)
    assert state.shape == (8, TINY.kda_num_heads, TINY.kda_head_dim, TINY.kda_head_dim)
    assert conv.shape == (8, TINY.conv_kernel_size - 1, 3 * TINY.kda_proj_dim)
    assert state.is_contiguous() and conv.is_contiguous(), "layer-major planes: the KDA kernels need contiguous pools"
    s1, c1 = pool.state_view(kda, pool.state_slot("a"))
    s1.fill_(2.0)
    c1[1, 3] = -1.0
    assert float(state[pool.state_slot("a")].sum()) == 2.0 * s1.numel() and float(conv.sum()) == -1.0
    assert float(pool.states.view(torch.float32).sum()) == 2.0 * s1.numel() - 1.0


def test_nvfp4_and_mxfp4_sections():
    pool = _pool("nvfp4", "mxfp4", block=16, blocks=2)
    layer = pool.layout.layers[0]
    lat = pool.page_view(0, layer, "latent")
    kv, r, d = TINY.kv_lora_rank, TINY.qk_rope_head_dim, TINY.index_head_dim
    # the latent page is one token-major row per token (codes | E4M3 block scales | k_pe), as the IR and
    # the MLA kernels read it; the key page is the indexer's two operands
    assert {k: (v.dtype, tuple(v.shape)) for k, v in lat.items()} == {
        "latent": (torch.uint8, (16, kv // 2 + kv // 16 + r))}
    key = pool.page_view(1, layer, "key")
    assert {k: (v.dtype, tuple(v.shape)) for k, v in key.items()} == {
        "keys": (torch.uint8, (16, d // 2)), "scales": (torch.uint8, (16, d // 32))}


def test_errors():
    pool = _pool(blocks=5, requests=2)
    pool.allocate("big", 24)  # 3 blocks of 8
    with pytest.raises(PoolExhausted, match=r"request 'huge' needs 4 more block\(s\) for 30 tokens .* only 2 of 5"):
        pool.allocate("huge", 30)
    with pytest.raises(PoolExhausted, match=r"request 'big' needs 3 more .*holds 3.* only 2 of 5"):
        pool.allocate("big", 48)
    assert pool.blocks_of("big") == [0, 1, 2] and pool.num_free_blocks == 2
    pool.allocate("b", 1)
    with pytest.raises(PoolExhausted, match="KDA state slot"):
        pool.allocate("c", 1)
    with pytest.raises(KeyError, match="'nobody' holds no blocks"):
        pool.free("nobody")
    table = pool.block_table(["big", "b"])
    with pytest.raises(IndexError, match="position 9.*block 1, which the request does not hold"):
        pool.slot_rows(table, torch.tensor([0, 1]), torch.tensor([3, 9]))
    with pytest.raises(IndexError, match="outside the block table"):
        pool.slot_rows(table, torch.tensor([0]), torch.tensor([24]))
    with pytest.raises(KeyError, match="sections"):
        pool.layer_view(pool.layout.layers[0], "key")
    with pytest.raises(KeyError, match="no 'latent' page for layer 0"):
        pool.layer_view(0, "latent")
    with pytest.raises(LayoutError, match="power of two"):
        plan_block_layout(TINY, 12)
    with pytest.raises(ValueError, match="at least one block"):
        BlockPool(plan_block_layout(TINY, 8), 0)
