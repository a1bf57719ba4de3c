"""The serving engine (k31c/runtime/engine.py) and hybrid prefix cache (prefix_cache.py) on a 4-layer
hybrid model (KDA + MLA with indexer, top-k 4 so contexts go sparse), paged in blocks of 4 rows.

Greedy outputs must not depend on how the work is scheduled: prefix caching on/off, chunked/unchunked
prefill and preemption give the same tokens, and the logits they were sampled from agree to fp32
rounding (different chunkings sum in a different order). The soak runs random arrivals, lengths and
cancellations through a pool too small for all of them and checks every request ends exactly once and
no block leaks."""

from __future__ import annotations

import dataclasses
import functools
import random

import pytest
import torch

from k31c.model.build import BuildOptions, build_module
from k31c.model.init_weights import random_weights
from k31c.model.presets import get_preset
from k31c.runtime.engine import Engine
from k31c.runtime.reference import ReferenceRuntime, RequestError
from k31c.runtime.sampling import SamplingParams
from k31c.runtime.tokenizer import ByteTokenizer

try:
    from tests.helpers import assert_close_rel
except ImportError:  # bare `pytest` without the repo root on sys.path
    from helpers import assert_close_rel

BS = 4


@functools.lru_cache(maxsize=None)
def _model(pool_view="blocks"):
    cfg = dataclasses.replace(get_preset("k31-tiny"), name="engine-tiny", num_hidden_layers=4,
                              full_attn_layers=(1, 3), index_topk=4)
    return build_module(cfg, BuildOptions(block_size=BS, pool_view=pool_view)), random_weights(cfg, 0)


def _engine(rows=256, requests=4, pool_view="blocks", **kw):
    m, w = _model(pool_view)
    return Engine(ReferenceRuntime(m, w, max_rows=rows, max_requests=requests), keep_logits=True, **kw)


def _prompts(n, shared=10, seed=0):
    g = torch.Generator().manual_seed(seed)
    sys_prompt = torch.randint(0, 256, (shared,), generator=g).tolist()
    return [sys_prompt + torch.randint(0, 256, (3 + 2 * i,), generator=g).tolist() for i in range(n)]


def _run(eng, prompts, new=4):
    for i, p in enumerate(prompts):
        eng.add_request(f"r{i}", p, SamplingParams(max_new_tokens=new))
    final = eng.run_to_completion()
    return {rid: o.tokens for rid, o in final.items()}, eng.kept_logits


@functools.lru_cache(maxsize=None)
def _baseline():
    return _run(_engine(), _prompts(3))


VARIANTS = {"prefix_cache": dict(prefix_caching=True, max_num_seqs=1),
            "chunked": dict(prefill_chunk=3, max_batched_tokens=7),
            "preemption": dict(rows=8 * BS, requests=3)}


@functools.lru_cache(maxsize=None)
def _variant_run(variant: str, pool_view: str = "blocks"):
    """(engine, tokens, logits) of the three-prompt run scheduled as `variant`."""
    eng = _engine(pool_view=pool_view, **VARIANTS[variant])
    return (eng, *_run(eng, _prompts(3)))


@pytest.mark.parametrize("variant", ["prefix_cache", "chunked", "preemption"])
def test_greedy_outputs_do_not_depend_on_scheduling(variant):
    want_tokens, want_logits = _baseline()
    eng, tokens, logits = _variant_run(variant)
    assert tokens == want_tokens
    for rid in want_logits:
        for a, b in zip(logits[rid], want_logits[rid]):
            assert_close_rel(a, b, 2e-5, f"{variant} {rid}")
    if variant == "preemption":
        assert eng.counters["preemptions"] > 0, "the pool should have been too small for all three"
    if variant == "prefix_cache":
        st = eng.stats()["prefix_cache"]
        assert st["hit_rate"]["latent_pages"] > 0 and st["hit_rate"]["reused_tokens"] > 0, st
    assert eng.rt.blocks.num_free + (eng.cache.held_blocks if eng.cache else 0) == eng.rt.blocks.num_blocks


@pytest.mark.parametrize("variant", ["prefix_cache", "preemption"])
def test_packed_pool_runtime_equals_the_flat_pool_runtime(variant):
    """The packed block pool (one row buffer, pools are its views) serves exactly what the previous
    runtime with one flat tensor per pool served: same tokens, bit-identical logits, with prefix caching
    and with preemption; the packed run's writes all landed in the pool (no copy back)."""
    packed, *got = _variant_run(variant)
    flat, *want = _variant_run(variant, "flat")
    assert packed.rt.block_pool is not None and flat.rt.block_pool is None
    assert got[0] == want[0]
    for rid in want[1]:
        assert len(got[1][rid]) == len(want[1][rid])
        for a, b in zip(got[1][rid], want[1][rid]):
            assert torch.equal(a, b), f"{variant} {rid}: packed-pool logits differ from the flat-pool runtime"
    assert packed.rt.pool_copies == 0
    if variant == "preemption":
        assert packed.counters["preemptions"] == flat.counters["preemptions"] > 0


def test_shared_prefix_hits_even_without_interval_checkpoints():
    """A 10-token system prompt (2 full blocks) then unique text: no interval checkpoint lies inside the
    shared part, yet from the third request on the shared blocks AND the KDA state are reused."""
    eng = _engine(prefix_caching=True, max_num_seqs=1, kda_checkpoint_interval=0)
    prompts = _prompts(4)
    _run(eng, prompts, new=1)
    st = eng.cache.stats
    assert st.checkpoints_stored >= 1
    assert st.reused_blocks >= 2 * 2, st   # requests 3 and 4 each skip the two shared blocks
    assert eng.stats()["prefix_cache"]["hit_rate"]["kda_state"] > 0
    eng.cache.clear()
    assert eng.rt.blocks.num_free == eng.rt.blocks.num_blocks and eng.rt.blocks.check() == []


def test_prefix_cache_eviction_frees_only_unreferenced_blocks():
    eng = _engine(rows=12 * BS, requests=2, prefix_caching=True, max_num_seqs=2)
    _run(eng, _prompts(4, seed=3), new=2)         # more prompt blocks than the pool: the cache must evict
    assert eng.cache.stats.evicted_blocks > 0
    assert eng.rt.blocks.check() == []
    assert eng.rt.blocks.num_free + eng.cache.held_blocks == eng.rt.blocks.num_blocks


def test_soak_random_arrivals_cancellations_small_pool():
    rnd = random.Random(7)
    eng = _engine(rows=6 * BS, requests=3, prefix_caching=True, max_batched_tokens=12, prefill_chunk=5,
                  tokenizer=ByteTokenizer(512))
    eng.keep_logits = False
    added, ended, cancelled, refused, t = [], {}, set(), [], 0
    prompts = _prompts(10, shared=6, seed=11)
    while len(added) + len(refused) < len(prompts) or eng.has_unfinished():
        if len(added) + len(refused) < len(prompts) and rnd.random() < 0.6:
            i = len(added) + len(refused)
            p = SamplingParams(max_new_tokens=rnd.randint(3, 8), temperature=rnd.choice([0.0, 0.8]), seed=i)
            n = len(prompts[i])
            try:
                eng.add_request(f"s{i}", prompts[i][:rnd.randint(n // 2, n)], p,
                                stop=["\x00"] if i % 4 == 0 else ())
                added.append(f"s{i}")
            except RequestError:
                refused.append(i)
        live = [r for r in added if r not in ended and r not in cancelled]
        if live and rnd.random() < 0.1:
            victim = rnd.choice(live)
            eng.cancel(victim)
            cancelled.add(victim)
        for out in eng.step():
            assert out.rid not in ended, f"{out.rid} reported finished twice"
            if out.finished:
                ended[out.rid] = out
        t += 1
        assert t < 400, "soak did not drain"
    assert set(ended) == set(added), "every admitted request ends exactly once"
    for rid, out in ended.items():
        assert (out.finish_reason == "cancelled") == (rid in cancelled)
        assert out.finish_reason in ("stop", "length", "stop_string", "cancelled")
    assert not refused, "every prompt here fits the pool"
    assert eng.counters["preemptions"] > 0
    eng.cache.clear()
    assert eng.rt.blocks.num_free == eng.rt.blocks.num_blocks and eng.rt.blocks.check() == []
    assert not eng.rt.requests and len(eng.rt.free_slots) == 3


def test_bad_requests_are_refused_and_others_keep_running():
    eng = _engine(rows=8 * BS, requests=2)
    eng.add_request("ok", [1, 2, 3], SamplingParams(max_new_tokens=2))
    with pytest.raises(RequestError, match=r"exceed the model context"):
        eng.add_request("long", [1] * 10, SamplingParams(max_new_tokens=eng.rt.max_context))
    with pytest.raises(RequestError, match=r"cache blocks of 4; the whole pool has"):
        eng.add_request("big", [1] * 60, SamplingParams(max_new_tokens=2))
    with pytest.raises(RequestError, match=r"outside the vocabulary.*top_p must be in \(0, 1\]"):
        eng.add_request("bad", [1, 99999], SamplingParams(top_p=0.0))
    with pytest.raises(RequestError, match="already in use"):
        eng.add_request("ok", [4], SamplingParams())
    with pytest.raises(RequestError, match="unknown request id 'ghost'"):
        eng.cancel("ghost")
    final = eng.run_to_completion()
    assert list(final) == ["ok"] and len(final["ok"].tokens) == 2 and final["ok"].finish_reason == "length"


def test_streaming_yields_each_token_once_and_stop_tokens_end_early():
    eng = _engine()
    want, _ = _baseline()
    toks = want["r0"]
    j = next(j for j in range(1, len(toks)) if toks[j] not in toks[:j])  # first new token value after the first
    eng.add_request("r0", _prompts(3)[0], SamplingParams(max_new_tokens=4, stop_token_ids=(toks[j],)))
    seen = []
    for out in eng.stream():
        seen += out.new_tokens
    assert seen == toks[:j + 1] and out.finished and out.finish_reason == "stop"


def test_verify_then_accept_rolls_back_to_the_accepted_prefix():
    """Verify 5 drafts, keep 2: the next decode equals a run that only ever saw those 2 tokens (KDA state
    restored from the verify step's per-token states, rejected latent rows ignored)."""
    from passes.pipeline import run_pipeline

    m, w = _model()
    fused = build_module(dataclasses.replace(get_preset("k31-tiny"), name="engine-tiny", num_hidden_layers=4,
                                             full_attn_layers=(1, 3), index_topk=4), BuildOptions(block_size=BS))
    run_pipeline(fused)
    prompt, drafts = list(range(5, 15)), [7, 99, 3, 250, 41]
    a = ReferenceRuntime(fused, w, max_rows=64, max_requests=1)
    a.add_request("x", 32)
    a.prefill({"x": prompt})
    a.verify({"x": drafts})
    a.accept("x", 2)
    assert a.length("x") == len(prompt) + 2
    got = a.decode({"x": 11})
    b = ReferenceRuntime(fused, w, max_rows=64, max_requests=1)
    b.add_request("x", 32)
    b.prefill({"x": prompt})
    b.verify({"x": drafts[:2]})
    want = b.decode({"x": 11})
    assert_close_rel(got, want, 1e-5, "decode after accept(2) vs verify of 2")
    with pytest.raises(RequestError, match="keep 1..5"):
        a.verify({"x": drafts})
        a.accept("x", 6)


def test_batched_device_sampler_path_gives_the_greedy_tokens_and_seeded_draws():
    """The engine's one-kernel sampling path (what it takes on a GPU; forced here, the kernel runs in the
    interpreter): greedy tokens equal the per-request host Sampler's; seeded temperature/top-p draws repeat
    exactly for the same seeds, stay inside the vocabulary, and a NaN row is refused by name."""
    want, _ = _baseline()
    got, _ = _run(_engine(device_sampling=True), _prompts(3))
    assert got == want
    seeded = []
    for _ in range(2):
        eng = _engine(device_sampling=True)
        for i, p in enumerate(_prompts(2)):
            eng.add_request(f"s{i}", p, SamplingParams(temperature=0.9, top_p=0.8, seed=10 + i, max_new_tokens=3))
        seeded.append({rid: o.tokens for rid, o in eng.run_to_completion().items()})
    vocab = eng.rt.vocab_size
    assert seeded[0] == seeded[1] and all(0 <= t < vocab for ts in seeded[0].values() for t in ts)
    eng = _engine(device_sampling=True)
    eng.add_request("nan", _prompts(1)[0], SamplingParams(max_new_tokens=1))
    with pytest.raises(FloatingPointError, match="nan"):
        eng._sample([(eng.seqs["nan"], 0)], torch.full((1, vocab), float("nan")))


@pytest.mark.parametrize("variant", ["plain", "prefix_cache", "preemption"])
def test_async_decode_serves_the_synchronous_tokens(variant):
    """Asynchronous decode (step N+1 launched on the ids step N's sampler left in the token feed, before
    the host reads them) returns the synchronous engine's tokens, with stop tokens ending requests mid-
    flight (their extra row discarded), prefix caching, a pool small enough to preempt, and cancellation;
    every block is free at the end and chained steps really ran."""
    kw = {} if variant == "plain" else VARIANTS[variant]
    want, _ = _baseline()
    stop = want["r1"][2]  # r1 stops on its third token: later requests keep running past it
    runs = []
    for async_decode in (False, True):
        eng = _engine(async_decode=async_decode, **kw)
        for i, p in enumerate(_prompts(3)):
            eng.add_request(f"r{i}", p, SamplingParams(max_new_tokens=4 + 2 * i, stop_token_ids=(stop,) * (i == 1)))
        eng.add_request("gone", _prompts(1, seed=3)[0], SamplingParams(max_new_tokens=6))
        final, n = {}, 0
        for out in eng.stream():
            n += 1
            if n == 5 and "gone" in eng.seqs:
                eng.cancel("gone")
            if out.finished:
                final[out.rid] = (out.tokens, out.finish_reason)
        held = eng.cache.held_blocks if eng.cache else 0
        assert eng.rt.blocks.num_free + held == eng.rt.blocks.num_blocks
        runs.append((final, dict(eng.counters)))
    assert runs[1][0] == runs[0][0]
    assert runs[0][0]["r1"][1] == "stop" and runs[0][0]["gone"][1] == "cancelled"
    assert runs[1][1]["chained_decode_steps"] > 0 and runs[0][1]["chained_decode_steps"] == 0
