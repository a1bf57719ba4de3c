"""gloo tests of the layouts beyond DCP, EP in {1, TP} (issue 8): DCP and EP groups inside TP, per-rank
DCP cache rows, dense MLA (K3) under DCP. Each layout's logits equal the single-process logits.

One forked gloo group per world size (2, 4, 8) runs every check in DIST_CHECKS (tests/dist_helpers.py);
the groups are built the way a launched run builds them (`k31c.parallel.groups.build_groups`: DCP and EP
groups are runs of consecutive ranks) and the runtime reserves cache blocks for each rank's share only
(`k31c.parallel.serving.use_local_cache_rows`). Models: `PAR_CFG` (k31-tiny cut to 4 layers with 8 KDA /
8 MLA heads, tests/test_parallel_model.py) and `K3_CFG`, the same without the DSA indexer (K3: dense MLA).
Caches use block size 8, so a 40-token request takes 5 blocks on one process and ceil(40/W/8) under DCP W.
Steps: prefill {a: 16, b: 16} (tokens whose context is shorter than W: empty shards), prefill {a: 16 more}
(context 32 > top-k 16: sparse), decode {a, b} twice. fp32; tolerance 1e-5 relative.

Layouts (world: TP = world):
    subgroups      W=2: DCP 2, EP 1        W=4: DCP 2, EP 2, interleave 2     W=8: DCP 4, EP 2, interleave 3
    merge-free     token-sharded prefill with DCP (gathered over the DCP group, tokens over TP) is bitwise
                   the token-sharded prefill without DCP on the same TP / EP layout
    dense K3       W=2: DCP 2       W=4: DCP 2 (token-sharded prefill: T5 on a dense layer)     W=8: DCP 8
    local rows     TP = DCP = W: both requests fit a pool of 8 blocks that one process cannot fit them in
    T7 caches      W=4: NVFP4 latents + MXFP4 keys (flat pools) with DCP 2 and token-sharded prefill
    query chunks   W=2: dcp_mla / dcp_mla_dense over chunks of 1-3 query tokens (a tiny CHUNK_ELEMENTS)
    value gate     W=2: dcp_mla / dcp_mla_dense in form "latent" + fused.value_gate (the value_gate pass)
    leader         W=2: rank 0's LeaderRuntime forwards add_request / grow / verify / accept / release
    graph-safe     W=2, 4 (subgroups): decode steps through the CUDA-graph-safe DCP references
                   (k31c.parallel.dcp_graph), and their static top-k merge vs dcp_topk on tied scores
"""

from __future__ import annotations

import functools

import pytest
import torch

from k31c.model.build import BuildOptions, build_module
from k31c.model.init_weights import random_weights
from k31c.parallel.groups import build_groups, group_ranks
from k31c.parallel.prefill_choice import choose_prefill_function
from k31c.parallel.serving import (LeaderRuntime, ParallelLayout, follow, rows_per_rank, shard_module,
                                   use_local_cache_rows)
from k31c.parallel.weights import shard_weights
from k31c.runtime.reference import PoolFull, ReferenceRuntime
from passes import shard_tokens
from tests.dist_helpers import check_result, results_per_world
from tests.helpers import assert_close_rel
from tests import test_parallel_model as par_model
from tests.test_parallel_model import PAR_CFG, STEPS, TOL

WORLDS = (2, 4, 8)
OPTS = BuildOptions(block_size=8)
# T7 caches under DCP: NVFP4 latents + MXFP4 keys, and (where the build has the option) flat pools instead of
# the default block views, so both pool forms go through the DCP ops
QUANT_OPTS = BuildOptions(block_size=8, latent_cache_dtype="nvfp4", key_cache="mxfp4",
                          **({"pool_view": "flat"} if "pool_view" in BuildOptions.__dataclass_fields__ else {}))
QUANT_WORLDS = (4,)
K3_CFG = PAR_CFG.replace(name="k3-tiny-par8", index_n_heads=0, index_head_dim=0, index_topk=0).validate()
CAPACITY = 40        # tokens each request may reach ("a" ends at 34)
POOL_ROWS = 48       # max_rows of the runtime: (48/8 + 2 requests) = 8 blocks of 8 rows
SUBGROUPS = {2: dict(dcp=2, ep=1, dcp_interleave=1), 4: dict(dcp=2, ep=2, dcp_interleave=2),
             8: dict(dcp=4, ep=2, dcp_interleave=3)}
DENSE = {2: dict(dcp=2, ep=2, tokens=False), 4: dict(dcp=2, ep=4, tokens=True), 8: dict(dcp=8, ep=8, tokens=False)}


MODELS = {"par": (PAR_CFG, OPTS), "k3": (K3_CFG, OPTS), "quant": (PAR_CFG, QUANT_OPTS)}


@functools.lru_cache(maxsize=None)
def weights(name: str):
    return random_weights(MODELS[name][0], 0)


def runtime(module, w, local_rows: ParallelLayout | None = None):
    """Both requests admitted; under DCP (local rows) in the small pool, else in one that fits them."""
    dcp = local_rows is not None and local_rows.dcp > 1
    rt = ReferenceRuntime(module, w, max_rows=POOL_ROWS if dcp else 128, max_requests=2)
    if local_rows is not None:
        use_local_cache_rows(rt, local_rows)
    rt.add_request("a", CAPACITY)
    rt.add_request("b", CAPACITY)
    return rt


def serve(rt, token_sharded: bool = False) -> list[torch.Tensor]:
    out = []
    for fn, chunks in STEPS:
        if fn == "prefill" and token_sharded:
            fn = choose_prefill_function(rt.module, [len(c) for c in chunks.values()])
            assert fn == shard_tokens.TARGET, f"the step {[len(c) for c in chunks.values()]} was not token-sharded"
        out.append(rt.step(fn, chunks))
    return out


@functools.lru_cache(maxsize=None)
def reference_logits(name: str) -> tuple:
    """One process, a pool large enough for both requests. PAR_CFG's are test_parallel_model's (block size
    64 there, bitwise the same logits: the block size only addresses rows), computed once per session."""
    if name == "par":
        return par_model.reference_logits()
    rt = ReferenceRuntime(build_module(*MODELS[name]), weights(name), max_rows=128, max_requests=2)
    rt.add_request("a", CAPACITY)
    rt.add_request("b", CAPACITY)
    return tuple(serve(rt))


LEADER_WORLDS = (2,)


def leader_session(rt) -> list[torch.Tensor]:
    """STEPS the way an engine drives them: admit short with the engine's keywords, grow, and run the first
    decode step as a one-draft verify + accept (what speculative decoding does); same logits as STEPS."""
    (_, first), (_, second), (_, dec1), (_, dec2) = STEPS
    for rid in "ab":
        rt.add_request(rid, len(first[rid]) + 1, prefix_blocks=(), prefix_len=0)
    out = [rt.prefill(first)]
    rt.grow("a", CAPACITY)
    rt.grow("b", CAPACITY)
    out.append(rt.prefill(second))
    out.append(rt.verify(dec1))
    for rid in "ab":
        rt.accept(rid, 1)  # the draft kept (rolling back needs the fused module's per-token states)
    out.append(rt.decode({rid: t[0] for rid, t in dec2.items()}))
    for rid in "ab":
        rt.release(rid)
    return out


def prepare():
    for name in MODELS:
        reference_logits(name)


def sharded_runtime(name: str, layout: ParallelLayout, local_rows: bool = True):
    """This rank's runtime for `layout`: groups built, module sharded, weights sliced, local DCP rows."""
    build_groups(layout.tp, layout.dcp, layout.ep)
    m = shard_module(build_module(*MODELS[name]), layout)
    w = shard_weights(m, weights(name), tp_rank=layout.rank, ep_rank=layout.ep_rank)
    return runtime(m, w, layout if local_rows else None)


def compare(got, name: str, rank: int, what: str) -> dict:
    errs = [assert_close_rel(g, want, TOL, f"{what} step {i} ({STEPS[i][0]}) rank {rank}")
            for i, (g, want) in enumerate(zip(got, reference_logits(name)))]
    return {"max_rel_err": max(errs)}


# ---------------------------------------------------------------- distributed checks
def check_dcp_ep_subgroups(rank, world):
    """DCP and EP groups smaller than TP: indexer + exact top-k merge + LSE combine inside each DCP group,
    experts split inside each EP group; head-sharded prefill."""
    lay = ParallelLayout(tp=world, rank=rank, **SUBGROUPS[world])
    return compare(serve(sharded_runtime("par", lay)), "par", rank, f"TP={world} {SUBGROUPS[world]}")


def check_ep_subgroup_token_sharded(rank, world):
    """EP group inside TP with token-sharded prefill, no DCP: the baseline of the merge-free check."""
    sub = SUBGROUPS[world]
    lay = ParallelLayout(tp=world, ep=sub["ep"], rank=rank)
    got = serve(sharded_runtime("par", lay), token_sharded=True)
    BASELINE[world] = got
    return compare(got, "par", rank, f"TP={world} EP={sub['ep']} token-sharded")


def check_merge_free_prefill_in_dcp_subgroup(rank, world):
    """T5 with a DCP group inside TP: the context is gathered over the DCP group into a workspace addressed
    by its own table (the ranks' tables hold only their local blocks), tokens are sharded over TP; prefill
    logits are bitwise those of check_ep_subgroup_token_sharded."""
    lay = ParallelLayout(tp=world, rank=rank, **SUBGROUPS[world])
    rt = sharded_runtime("par", lay)
    assert rt.module.op_counts(shard_tokens.TARGET)["dcp_workspace_table"] == 1
    got = serve(rt, token_sharded=True)
    for i, (fn, _) in enumerate(STEPS):
        if fn == "prefill":
            assert torch.equal(got[i], BASELINE[world][i]), f"merge-free DCP prefill step {i} is not bitwise equal"
    return compare(got, "par", rank, f"TP={world} {SUBGROUPS[world]} merge-free prefill")


def check_local_cache_rows(rank, world):
    """Per-rank cache rows under DCP W = world: a request of L tokens takes ceil(ceil(L/W)/bs) blocks, so a
    pool of 8 blocks of 8 rows holds W·64 tokens of one request instead of 64, and both 40-token requests
    fit where one process (or TP alone) runs out of blocks; the logits still equal one process."""
    lay = ParallelLayout(tp=world, dcp=world, ep=world, rank=rank)
    one = ReferenceRuntime(build_module(PAR_CFG, OPTS), weights("par"), max_rows=POOL_ROWS, max_requests=2)
    one.add_request("a", CAPACITY)
    with pytest.raises(PoolFull):
        one.add_request("b", CAPACITY)                           # 5 + 5 blocks > 8
    rt = sharded_runtime("par", lay)
    nb, bs = rt.blocks.num_blocks, rt.block_size
    assert (nb, bs) == (8, 8)
    assert rt.blocks_for(world * nb * bs) == nb and rt.blocks_for(world * nb * bs + 1) == nb + 1
    assert len(rt.blocks_of("a")) == -(-rows_per_rank(CAPACITY, world) // bs) == -(-(-(-CAPACITY // world)) // bs)
    info = compare(serve(rt), "par", rank, f"TP=DCP={world} local cache rows")
    return {**info, "blocks_per_request": len(rt.blocks_of("a")), "tokens_per_pool": world * nb * bs,
            "one_process_tokens_per_pool": nb * bs}


def check_dense_mla_dcp(rank, world):
    """K3 (no indexer): every rank attends over all the positions it stores, LSE combine over the DCP
    group; at W=4 the DCP group is half the TP group and prefill is token-sharded over the gathered
    context (T5 for a dense layer)."""
    d = DENSE[world]
    lay = ParallelLayout(tp=world, dcp=d["dcp"], ep=d["ep"], rank=rank)
    rt = sharded_runtime("k3", lay)
    assert rt.module.op_counts("decode")["dcp_mla_dense"] == len(K3_CFG.full_attn_layers)
    return compare(serve(rt, token_sharded=d["tokens"]), "k3", rank, f"K3 TP={world} {d}")


def check_quantised_caches_dcp(rank, world):
    """NVFP4 latents and MXFP4 index keys under a DCP group inside TP: dcp_mla reads them as the reference
    does (token-sharded prefill gathers the raw code bytes)."""
    if world not in QUANT_WORLDS:
        return {"max_rel_err": 0.0, "skipped": f"run at W in {QUANT_WORLDS} only: dcp_mla reads NVFP4 / MXFP4 "
                                               f"pages with the same code at every W (each world size adds time)"}
    lay = ParallelLayout(tp=world, rank=rank, **SUBGROUPS[world])
    rt = sharded_runtime("quant", lay)
    node = next(n for n in rt.module.function("decode").nodes if n.op == "dcp_mla")
    assert (node.attrs["latent_format"], node.attrs["key_format"]) == ("nvfp4", "mxfp4")
    return compare(serve(rt, token_sharded=True), "quant", rank, f"TP={world} {SUBGROUPS[world]} NVFP4+MXFP4")


CHUNK_WORLDS = (2,)


def check_dcp_query_chunks(rank, world):
    """dcp_mla and dcp_mla_dense run in chunks of query tokens when a step's temporaries would pass
    CHUNK_ELEMENTS (made tiny here: chunks of 1-3 tokens, so prefill steps of 16-32 tokens take many
    rounds of collectives, each rank as many as the others); the logits still equal one process."""
    if world not in CHUNK_WORLDS:
        return {"max_rel_err": 0.0, "skipped": f"run at W in {CHUNK_WORLDS} only: the chunking and the latent form "
                                               f"are the same code at every W (each world size adds ~10 s)"}
    from k31c.parallel import dcp_attention

    lay = ParallelLayout(tp=world, dcp=world, ep=world, rank=rank)
    old, dcp_attention.CHUNK_ELEMENTS = dcp_attention.CHUNK_ELEMENTS, 3000
    try:
        assert dcp_attention.row_chunk(torch.tensor([39]), world, 100, 0, 0) == 1
        errs = [compare(serve(sharded_runtime(name, lay)), name, rank, f"{name} TP=DCP={world} query chunks")
                for name in ("par", "k3")]
    finally:
        dcp_attention.CHUNK_ELEMENTS = old
    return {"max_rel_err": max(e["max_rel_err"] for e in errs)}


def check_value_gate_under_dcp(rank, world):
    """The value_gate fusion on DCP attention (dcp_mla form "latent" + fused.value_gate, run by the fused
    op's reference body here), sparse (par) and dense (K3): logits still equal one process."""
    if world not in CHUNK_WORLDS:
        return {"max_rel_err": 0.0, "skipped": f"run at W in {CHUNK_WORLDS} only: the chunking and the latent form "
                                               f"are the same code at every W (each world size adds ~10 s)"}
    from passes import value_gate
    from passes.base import PassContext

    lay = ParallelLayout(tp=world, dcp=world, ep=world, rank=rank)
    errs = []
    for name in ("par", "k3"):
        build_groups(lay.tp, lay.dcp, lay.ep)
        m = shard_module(build_module(*MODELS[name]), lay)
        assert value_gate.run(m, PassContext()) > 0 and m.op_counts("decode")["fused.value_gate"] == 1
        rt = runtime(m, shard_weights(m, weights(name), tp_rank=rank, ep_rank=lay.ep_rank), lay)
        errs.append(compare(serve(rt), name, rank, f"{name} TP=DCP={world} value gate fused")["max_rel_err"])
    return {"max_rel_err": max(errs)}


def check_leader_replays_grow_verify_accept(rank, world):
    """Rank 0 drives a LeaderRuntime (as `k31c run` does through the engine), the other ranks `follow`:
    add_request with the engine's keywords, grow, verify + accept and release reach every rank (TP = DCP)."""
    if world not in LEADER_WORLDS:
        return {"max_rel_err": 0.0, "skipped": f"run at W in {LEADER_WORLDS} only: rank 0's broadcast and the "
                                               f"followers' replay are the same at every W (each world size adds time)"}
    build_groups(world, world, world)
    lay = ParallelLayout(tp=world, dcp=world, ep=world, rank=rank)
    m = shard_module(build_module(PAR_CFG, OPTS), lay)
    rt = ReferenceRuntime(m, shard_weights(m, weights("par"), tp_rank=rank, ep_rank=lay.ep_rank), max_rows=128,
                          max_requests=2)
    use_local_cache_rows(rt, lay)
    if rank:
        assert follow(rt) == len(STEPS) and not rt.requests  # prefill, prefill, verify, decode; released
        return {"max_rel_err": 0.0}
    leader = LeaderRuntime(rt)
    got = leader_session(leader)
    leader.stop()
    return compare(got, "par", rank, f"TP=DCP={world} leader")


GRAPH_WORLDS = (2, 4)


def check_graph_safe_dcp_decode(rank, world):
    """Decode steps run as a CUDA-graph capture runs them (Executor.static_context set: dcp_cache_write,
    dcp_mla and dcp_mla_dense with static=True, `k31c.parallel.dcp_graph`): logits equal one
    process, sparse and dense; the static merge selects exactly what dcp_topk selects, ties included."""
    if world not in GRAPH_WORLDS:
        return {"max_rel_err": 0.0, "skipped": f"run at W in {GRAPH_WORLDS} only: the static references are the "
                                               f"same code at every W (each world size adds time)"}
    from ir.ops.collective import get_group
    from k31c.parallel.dcp_topk import dcp_topk, local_count, static_topk_own_positions
    from k31c.runtime.executor import Executor

    from collections import Counter

    from k31c.runtime import cuda_graphs

    lay = ParallelLayout(tp=world, rank=rank, **SUBGROUPS[world])
    errs, calls = [], Counter()
    safe = dict(cuda_graphs.GRAPH_SAFE_REFERENCE)
    for op, fn in safe.items():  # count that the static references ran
        cuda_graphs.GRAPH_SAFE_REFERENCE[op] = lambda a, at, op=op, fn=fn: (calls.update([op]), fn(a, at))[1]
    for name in ("par", "k3"):
        build_groups(lay.tp, lay.dcp, lay.ep)
        m = shard_module(build_module(*MODELS[name]), lay)
        w = shard_weights(m, weights(name), tp_rank=rank, ep_rank=lay.ep_rank)
        eng = Executor(m, w, [])  # no kernels: every node runs its reference, the graph-safe one when static
        rt = ReferenceRuntime(m, w, max_rows=POOL_ROWS, max_requests=2, engine=eng)
        use_local_cache_rows(rt, lay)
        rt.add_request("a", CAPACITY)
        rt.add_request("b", CAPACITY)
        got = []
        for fn, chunks in STEPS:
            eng.static_context = rt.block_size if fn == "decode" else None  # any bound: the refs read the table
            got.append(rt.step(fn, chunks))
        eng.static_context = None
        errs.append(compare(got, name, rank, f"{name} TP={world} {SUBGROUPS[world]} graph-safe decode")["max_rel_err"])
    cuda_graphs.GRAPH_SAFE_REFERENCE.update(safe)
    layers = len(PAR_CFG.full_attn_layers)
    assert calls == {"dcp_mla": 2 * layers, "dcp_mla_dense": 2 * layers, "dcp_cache_write": 2 * 2 * 2 * layers}, calls
    group = get_group("dcp")
    g = torch.Generator().manual_seed(11)
    n_local, k, il = 24, 10, lay.dcp_interleave
    scores = torch.randint(0, 4, (6, n_local), generator=g).float()  # many ties across ranks
    ctx = torch.tensor([1, 5, 9, 20, 33, n_local * lay.dcp])
    mine = scores[:, torch.randperm(n_local, generator=g)]
    counts = torch.arange(n_local)[None, :] < local_count(ctx, lay.dcp_rank, lay.dcp, il)[:, None]
    want = dcp_topk(mine, k, ctx_len=ctx, interleave=il, group=group).own_positions
    got = static_topk_own_positions(torch.where(counts, mine, float("-inf")), counts, k, ctx, il, group)
    assert torch.equal(got, want), f"rank {rank}: static merge {got.tolist()} vs dcp_topk {want.tolist()}"
    return {"max_rel_err": max(errs)}


DIST_CHECKS = [check_dcp_ep_subgroups, check_ep_subgroup_token_sharded, check_merge_free_prefill_in_dcp_subgroup,
               check_local_cache_rows, check_dense_mla_dcp, check_quantised_caches_dcp,
               check_dcp_query_chunks, check_value_gate_under_dcp, check_leader_replays_grow_verify_accept,
               check_graph_safe_dcp_decode]
BASELINE: dict = {}


# ---------------------------------------------------------------- pytest side
@pytest.fixture(scope="module")
def results():
    return results_per_world(__name__, prepare=prepare)


@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("check", [f.__name__ for f in DIST_CHECKS])
def test_layout_logits_equal_single_process(results, world, check):
    info = check_result(results(world), check, world)["info"]
    if "skipped" in info:  # a check run at some world sizes only says so instead of passing empty
        pytest.skip(info["skipped"])
    assert info["max_rel_err"] < TOL


@pytest.mark.parametrize("world", WORLDS)
def test_dcp_capacity_is_world_times_one_process(results, world):
    info = check_result(results(world), "check_local_cache_rows", world)["info"]
    assert info["tokens_per_pool"] == world * info["one_process_tokens_per_pool"]
    assert info["blocks_per_request"] == -(-(-(-CAPACITY // world)) // OPTS.block_size)


def test_weight_shards_do_not_hold_the_full_tensors():
    """A rank's shard owns storage of its own size: once the full checkpoint is dropped, only 1/TP of each
    split weight stays (a view would keep every full tensor alive on every rank)."""
    lay = ParallelLayout(tp=2, ep=2, rank=1)
    m = shard_module(build_module(PAR_CFG, OPTS), lay)
    w = shard_weights(m, weights("par"), tp_rank=1, ep_rank=1)
    split = [n for n, p in m.params.items() if "tp_parts" in p.attrs or "ep_parts" in p.attrs]
    assert split
    for n in split:
        t = w[n]
        for part in ((t.packed, t.scales) if hasattr(t, "packed") else (t,)):
            assert part.untyped_storage().nbytes() == part.numel() * part.element_size(), n


def test_group_ranks_are_runs_of_consecutive_ranks():
    g = group_ranks(8, dcp=2, ep=4)
    assert g["tp"] == [list(range(8))]
    assert g["dcp"] == [[0, 1], [2, 3], [4, 5], [6, 7]] and g["ep"] == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert ParallelLayout(tp=8, dcp=2, ep=4, rank=5).dcp_rank == 1 and ParallelLayout(tp=8, ep=4, rank=5).ep_rank == 1


def test_layout_problems_are_reported_together():
    cfg = PAR_CFG.replace(num_experts=112)
    problems = ParallelLayout(tp=4, dcp=3, ep=3).problems(cfg)
    assert "--dcp 3 does not divide --tp 4 (a DCP group is a run of --dcp ranks of the TP group)" in problems
    assert any(p.startswith("--ep 3 does not divide --tp 4") for p in problems)
    assert "--ep 3 does not divide the 112 experts of k31-tiny-par8" in problems
    assert ParallelLayout(tp=8, dcp=2, ep=4).problems(PAR_CFG) == []
    assert ParallelLayout(tp=0).problems() == ["--tp must be a positive integer, found 0"]
