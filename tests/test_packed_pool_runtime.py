"""The packed block pool is the runtime's allocation (DESIGN §5 T1, issue 7 item 1).

`ReferenceRuntime` on a default build (pool inputs are block views [NB, bs, *row]) allocates ONE
`BlockPool`: every MLA / indexer pool input is a typed view of its rows and every KDA state / conv pool
a view of its slot pool. Checked here:
- the runtime's layout is plan.json's `cache_layout` (`plan_block_layout`) byte for byte;
- the views are views of the two buffers, cover exactly the planned sections and never overlap;
- a step's in-place writes land at the planned byte addresses (`BlockPool.token_addresses`, the KDA
  slot planes), holding exactly what the previous flat-pool runtime (`pool_view="flat"`, one tensor per
  pool) holds at the same rows, and the logits are bit-identical to it."""

from __future__ import annotations

import dataclasses
import functools

import pytest
import torch

from k31c.model.build import BuildOptions, build_module
from k31c.model.init_weights import random_weights
from k31c.model.presets import get_preset
from k31c.runtime.block_layout import plan_block_layout
from k31c.runtime.reference import ReferenceRuntime

BS = 4
CFG = dataclasses.replace(get_preset("k31-tiny"), name="packed-tiny", num_hidden_layers=4, full_attn_layers=(1, 3),
                          index_topk=4)
FORMATS = [("f8e4m3", "fp8"), ("nvfp4", "mxfp4")]
PLAN_LATENT = {"f8e4m3": "fp8", "nvfp4": "nvfp4"}


@functools.lru_cache(maxsize=None)
def _weights():
    return random_weights(CFG, 0)


def _runtime(latent: str, key: str, view: str, rows=40, requests=3) -> ReferenceRuntime:
    m = build_module(CFG, BuildOptions(block_size=BS, latent_cache_dtype=latent, key_cache=key, pool_view=view))
    return ReferenceRuntime(m, _weights(), max_rows=rows, max_requests=requests)


def _steps(rt: ReferenceRuntime) -> list[torch.Tensor]:
    """Two requests with a shared-length prefill, a chunk and two decodes (blocks taken in the same order
    in every runtime, so physical rows agree)."""
    g = torch.Generator().manual_seed(3)
    tok = lambda n: torch.randint(0, CFG.vocab_size, (n,), generator=g).tolist()  # noqa: E731
    rt.add_request("a", 14)
    rt.add_request("b", 9)
    out = [rt.prefill({"a": tok(7), "b": tok(5)}), rt.prefill({"a": tok(3)})]
    out += [rt.decode({"a": tok(1)[0], "b": tok(1)[0]}), rt.decode({"b": tok(1)[0]})]
    return out


def _byte_offsets(view: torch.Tensor) -> torch.Tensor:
    """Byte offsets (into its storage) of every byte of a strided view."""
    es = view.element_size()
    elems = view.untyped_storage().nbytes() // es
    idx = torch.arange(elems, dtype=torch.int64).as_strided(view.shape, view.stride(), view.storage_offset())
    return (idx.reshape(-1, 1) * es + torch.arange(es)).reshape(-1)


@pytest.mark.parametrize("latent,key", FORMATS)
def test_runtime_layout_is_the_planned_layout(latent, key):
    rt = _runtime(latent, key, "blocks")
    plan = plan_block_layout(CFG, BS, PLAN_LATENT[latent], key, alignment=128)
    assert rt.block_pool.layout == plan
    assert rt.block_pool.rows.shape == (rt.blocks.num_blocks, plan.row_bytes)
    assert rt.block_pool.states.shape == (3, plan.state.slot_bytes)


@pytest.mark.parametrize("latent,key", FORMATS)
def test_pools_are_disjoint_views_of_one_buffer(latent, key):
    rt = _runtime(latent, key, "blocks")
    pool = rt.block_pool
    rows_ptr, states_ptr = pool.rows.untyped_storage().data_ptr(), pool.states.untyped_storage().data_ptr()
    covered = {"rows": [], "states": []}
    for name, view in rt.pools.items():
        ptr = view.untyped_storage().data_ptr()
        which = "states" if name.startswith(("kda_state", "conv_state")) else "rows"
        assert ptr == (states_ptr if which == "states" else rows_ptr), f"{name} is not a view of the packed {which}"
        offs = _byte_offsets(view)
        buf = pool.states if which == "states" else pool.rows
        assert int(offs.min()) >= 0 and int(offs.max()) < buf.numel(), f"{name} reaches outside the pool"
        covered[which].append(offs)
    for which, parts in covered.items():
        allb = torch.cat(parts)
        assert allb.numel() == torch.unique(allb).numel(), f"two pool views overlap in the {which} buffer"
    assert sum(p.numel() for p in covered["rows"]) == pool.num_blocks * pool.layout.payload_bytes
    assert sum(p.numel() for p in covered["states"]) == 3 * sum(
        pool.layout.state.state_bytes_per_layer + pool.layout.state.conv_bytes_per_layer
        for _ in pool.layout.state.layers)


@pytest.mark.parametrize("latent,key", FORMATS)
def test_writes_land_at_planned_addresses_and_match_the_flat_runtime(latent, key):
    packed, flat = _runtime(latent, key, "blocks"), _runtime(latent, key, "flat")
    for a, b in zip(_steps(packed), _steps(flat)):
        assert torch.equal(a, b), "logits differ from the flat-pool runtime"
    assert packed.pool_copies == 0, "an engine returned a pool in new memory: the writes did not land in place"
    pool, lay = packed.block_pool, packed.block_pool.layout
    raw = pool.rows.view(-1)
    for rid, n in (("a", 11), ("b", 7)):
        blocks = torch.tensor(packed.blocks_of(rid))
        pos = torch.arange(n)
        rows, slots = blocks[pos // BS], pos % BS
        assert torch.equal(rows, torch.tensor(flat.blocks_of(rid))[pos // BS])
        for layer in lay.layers:
            for pool_name, kind, sec in ((f"latent.{layer}", "latent", "latent"),
                                         (f"index_keys.{layer}", "key", "keys"),
                                         (f"index_scales.{layer}", "key", "scales")):
                addr = pool.token_addresses(rows, slots, layer, kind, sec)
                nb = lay.page(layer, kind).section(sec).bytes_per_token()
                got = raw[addr.unsqueeze(1) + torch.arange(nb)]
                want = flat.pools[pool_name][rows * BS + slots].contiguous().view(torch.uint8).reshape(n, nb)
                assert torch.equal(got, want), f"{pool_name} of {rid} is not at its planned address"
                assert bool(got.any()), f"{pool_name}: nothing was written"
    st, raw_s = lay.state, pool.states.view(-1)
    for layer in st.layers:
        so, co = st.offsets(layer)
        for rid in ("a", "b"):
            slot = packed.requests[rid].slot
            for off, nb, name in ((so, st.state_bytes_per_layer, "kda_state"), (co, st.conv_bytes_per_layer, "conv_state")):
                start = 3 * off + slot * nb  # layer-major planes: S * offset + slot * bytes
                want = flat.pools[f"{name}.{layer}"][slot].contiguous().view(torch.uint8).reshape(-1)
                assert torch.equal(raw_s[start:start + nb], want), f"{name}.{layer} of {rid} misplaced"


def test_flat_and_block_view_modules_print_what_the_pool_is():
    from ir.printer import print_module

    blocks = print_module(build_module(CFG, BuildOptions(block_size=BS)))
    flat = print_module(build_module(CFG, BuildOptions(block_size=BS, pool_view="flat")))
    assert "%latent.1: f8e4m3[NB,4,80]" in blocks and "%index_scales.1: f32[NB,4]" in blocks
    assert "%latent.1: f8e4m3[N,80]" in flat and "%index_scales.1: f32[N]" in flat
    with pytest.raises(ValueError, match="pool_view must be one of"):
        build_module(CFG, BuildOptions(pool_view="rows"))
