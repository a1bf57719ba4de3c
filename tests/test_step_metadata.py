"""The fused step-metadata kernel (codegen/triton/step_metadata.py, k31c/runtime/step_metadata.py) builds
exactly the tensors `ReferenceRuntime._metadata` builds, for random requests (random cached lengths,
chunk sizes, scattered shared blocks), and pads a batch with scratch-only requests."""

from __future__ import annotations

import random

import pytest
import torch

from types import SimpleNamespace

from k31c.runtime.blocks import BlockAllocator
from k31c.runtime.reference import ReferenceRuntime, RequestError, _Request
from k31c.runtime.step_metadata import StepMetadataBuilder, check_step, pack_rows

KEYS = ("tokens", "token_pos", "token_req", "cu_seqlens", "block_table", "state_slot")


class _Runtime(SimpleNamespace):
    """What `ReferenceRuntime._metadata` reads (module, requests, vocabulary, device), without pools."""
    _metadata = ReferenceRuntime._metadata


def _runtime(tiny, max_requests=6, num_blocks=64):
    cfg, module, _ = tiny("k31-tiny")
    return _Runtime(module=module, requests={}, vocab_size=cfg.vocab_size, device=torch.device("cpu"),
                    block_size=int(module.attrs.get("block_size", 1)), blocks=BlockAllocator(num_blocks),
                    free_slots=list(range(max_requests)))


def _admit(rt, rid: str, capacity: int, prefix: list[int] = ()):
    own = rt.blocks.allocate(-(-capacity // rt.block_size) - len(prefix))
    rt.requests[rid] = _Request(rid, rt.free_slots.pop(0), capacity, list(prefix) + own, 0)


def _random_step(rt, rng: random.Random, fn: str, n_req: int) -> dict:
    """Admit n_req requests with random capacities/lengths (some sharing a first block) and return chunks."""
    chunks, shared = {}, None
    for i in range(n_req):
        cap = rng.randint(8, 300)
        _admit(rt, f"q{i}", cap, [shared] if shared is not None and rng.random() < 0.5 else [])
        shared = shared if shared is not None else rt.requests[f"q{i}"].blocks[0]
        n_new = 1 if fn == "decode" else rng.randint(1, 8)
        r = rt.requests[f"q{i}"]
        r.length = rng.randint(0, cap - n_new)
        chunks[f"q{i}"] = [rng.randrange(rt.vocab_size) for _ in range(n_new)]
    return dict(sorted(chunks.items(), key=lambda kv: rng.random()))  # requests in random order


@pytest.mark.parametrize("fn,seed", [("decode", 0), ("prefill", 1), ("verify", 2), ("prefill", 3)])
def test_fused_metadata_equals_reference_runtime(tiny, fn, seed):
    rng = random.Random(seed)
    rt = _runtime(tiny)
    chunks = _random_step(rt, rng, fn, rng.randint(1, 6))
    want = rt._metadata(fn, chunks)
    got = StepMetadataBuilder("cpu").build(check_step(rt, fn, chunks))
    for k in KEYS:
        assert got[k].dtype == want[k].dtype, f"{k}: {got[k].dtype} vs {want[k].dtype}"
        assert torch.equal(got[k], want[k]), f"{fn} seed {seed}: {k} differs:\n{got[k]}\nvs\n{want[k]}"


def test_padding_rows_touch_only_scratch(tiny):
    rng = random.Random(7)
    rt = _runtime(tiny)
    chunks = _random_step(rt, rng, "decode", 3)
    want = rt._metadata("decode", chunks)
    scratch = (rt.blocks.allocate(1)[0], rt.free_slots.pop())
    width = want["block_table"].shape[1] + 2
    got = StepMetadataBuilder("cpu").build(check_step(rt, "decode", chunks), width=width, pad_to=8, scratch=scratch)
    assert torch.equal(got["tokens"][:3], want["tokens"]) and torch.equal(got["token_pos"][:3], want["token_pos"])
    assert torch.equal(got["block_table"][:3, :width - 2], want["block_table"])
    assert (got["block_table"][:3, width - 2:] == -1).all()
    assert got["block_table"][3:, 0].eq(scratch[0]).all() and (got["block_table"][3:, 1:] == -1).all()
    assert got["state_slot"][3:].eq(scratch[1]).all() and torch.equal(got["state_slot"][:3], want["state_slot"])
    assert got["token_pos"][3:].eq(0).all() and torch.equal(got["token_req"], torch.arange(8))
    assert torch.equal(got["cu_seqlens"], torch.arange(9))


def test_writes_into_given_buffers_and_rejects_wrong_ones(tiny):
    rng = random.Random(11)
    rt = _runtime(tiny)
    chunks = _random_step(rt, rng, "decode", 2)
    want = rt._metadata("decode", chunks)
    static = {k: torch.full_like(v, 99) for k, v in want.items()}
    got = StepMetadataBuilder("cpu").build(check_step(rt, "decode", chunks), out=static)
    assert all(got[k] is static[k] and torch.equal(static[k], want[k]) for k in KEYS)
    static["block_table"] = static["block_table"].to(torch.int64)
    with pytest.raises(ValueError, match="block_table"):
        StepMetadataBuilder("cpu").build(check_step(rt, "decode", chunks), out=static)
    with pytest.raises(ValueError, match="scratch"):
        pack_rows(check_step(rt, "decode", chunks), pad_to=4)


def test_check_step_rejects_like_the_runtime(tiny):
    rt = _runtime(tiny)
    _admit(rt, "a", 4)
    bad = {"a": [1, 2], "zz": [3]}
    with pytest.raises(RequestError) as ref:
        rt._metadata("decode", bad)
    with pytest.raises(RequestError) as ours:
        check_step(rt, "decode", bad)
    assert str(ours.value) == str(ref.value)


@pytest.mark.parametrize("seed,n_req,pad_to", [(5, 3, 4), (6, 4, 4), (8, 1, 8)])
def test_graph_metadata_strided_layout_equals_the_builder(tiny, seed, n_req, pad_to):
    """The CUDA-graph prologue (pinned buffer in the strided layout, expanded by the same kernel) builds
    what the packed builder builds for the same padded bucket; rewriting it for a second step with fewer
    requests and shorter tables leaves nothing of the first step behind."""
    from k31c.runtime.step_metadata import GraphMetadata

    rng = random.Random(seed)
    rt = _runtime(tiny)
    chunks = _random_step(rt, rng, "decode", n_req)
    rows = check_step(rt, "decode", chunks)
    scratch = (rt.blocks.allocate(1)[0], rt.free_slots.pop())
    width = max(len(b) for _, _, b, _ in rows) + 3
    gm = GraphMetadata(pad_to, width, scratch, "cpu")
    static = {k: torch.full_like(v, 99) for k, v in StepMetadataBuilder("cpu").build(
        rows, width=width, pad_to=pad_to, scratch=scratch).items()}
    for step_rows in (rows, rows[:1]):
        want = StepMetadataBuilder("cpu").build(step_rows, width=width, pad_to=pad_to, scratch=scratch)
        gm.write(step_rows)
        gm.upload()
        got = gm.expand(static)
        for k in KEYS:
            assert got[k] is static[k] and torch.equal(got[k], want[k]), f"{k} ({len(step_rows)} rows) differs"
    with pytest.raises(ValueError, match="batch bucket"):
        gm.write(rows * (pad_to // len(rows) + 1))
    with pytest.raises(ValueError, match="at most"):
        GraphMetadata(pad_to, 1, scratch, "cpu").write([(0, 0, [1, 2], [3])])  # two blocks, width 1


def test_block_rows_mirror_the_runtime_lists(tiny):
    """BlockRows (the graph replay's int32 block rows) equals each request's list after every growth, starts
    again for a new request under a reused id or a shorter list, forgets ids on request, and its rows written
    by GraphMetadata give the same buffer as the lists."""
    from k31c.runtime.step_metadata import BlockRows, GraphMetadata

    rng = random.Random(11)
    rt = _runtime(tiny)
    mirror = BlockRows()
    rids = ["a", "b", "c"]
    for rid in rids:
        _admit(rt, rid, 3 * rt.block_size)
    for step in range(40):
        rid = rng.choice(rids)
        r = rt.requests[rid]
        if step % 9 == 8:  # a new request object under the same id
            r = rt.requests[rid] = _Request(rid, r.slot, r.capacity, list(r.blocks[:2]), 0)
        elif step % 13 == 12:
            r.blocks = r.blocks[:1]  # shorter: rebuilt, not trusted
        else:
            r.blocks += [rng.randrange(1000) for _ in range(rng.randrange(0, 40))]
        got = mirror.row(rid, r)
        assert got.dtype.name == "int32" and got.tolist() == r.blocks, f"step {step}: {rid} differs"
    chunks = {rid: [1] for rid in rids}  # the replay's check: the same rows, block ids left to the mirror
    assert [(n, s, [], t) for n, s, _, t in check_step(rt, "decode", chunks)] == \
        check_step(rt, "decode", chunks, copy_blocks=False)
    mirror.forget(rids[:1])
    assert len(mirror) == 1
    rows = [(3, 0, list(rt.requests[rids[0]].blocks), [5])]
    width = len(rows[0][2]) + 2
    lists, arrays = (GraphMetadata(2, width, (0, 0), "cpu") for _ in range(2))
    lists.write(rows)
    arrays.write([(3, 0, mirror.row(rids[0], rt.requests[rids[0]]), [5])])
    n = len(rows[0][2])
    read = [torch.cat([g._stage[:g.blocks_at], g._stage[g.blocks_at:g.blocks_at + n],  # what the expansion reads:
                       g._stage[g.blocks_at + width:g.blocks_at + width + 1], g._stage[g.tokens_at:]])  # headers,
            for g in (lists, arrays)]  # the row's n block ids, the padding row's scratch block, the tokens
    assert torch.equal(*read)
