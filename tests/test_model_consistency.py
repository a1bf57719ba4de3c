"""Whole-model consistency of the model written once (SPEC §2–6) through the reference runtime:
decode == prefill, verify == decode, chunked == unchunked prefill, batched == alone, causality,
MXFP4 experts == their dequantised values. Every comparison is on fresh random prompts."""

from __future__ import annotations

import pytest
import torch

from ir.packed import PackedMXFP4
from k31c.model.build import build_module
from k31c.runtime.reference import ReferenceRuntime, RequestError
from tests.helpers import assert_close_rel

PRESETS = ["k31-tiny", "k3-tiny", "kimi-linear-tiny"]


def _runtime(tiny, preset, dtype=torch.float32, rows=512, requests=4):
    cfg, module, weights = tiny(preset)
    return cfg, ReferenceRuntime(module, weights, max_rows=rows, max_requests=requests, compute_dtype=dtype)


def _prompt(cfg, n, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, cfg.vocab_size, (n,), generator=g).tolist()


def _prefill_all(rt, rid, toks):
    rt.add_request(rid, len(toks) + 8)
    out = rt.prefill({rid: toks})
    rt.release(rid)
    return out


@pytest.mark.parametrize("preset", PRESETS)
def test_decode_equals_prefill(tiny, preset):
    # 40 tokens > index_topk = 16, so later decode steps attend sparsely
    cfg, rt = _runtime(tiny, preset, torch.float64)
    toks = _prompt(cfg, 40, seed=1)
    full = _prefill_all(rt, "full", toks)
    rt.add_request("inc", 48)
    rows = [rt.prefill({"inc": toks[:25]})] + [rt.decode({"inc": t}) for t in toks[25:]]
    assert_close_rel(torch.cat(rows), full, 1e-9, f"{preset}: decode vs prefill (fp64)")


def test_decode_equals_prefill_fp32(tiny):
    cfg, rt = _runtime(tiny, "k31-tiny", torch.float32)
    toks = _prompt(cfg, 36, seed=2)
    full = _prefill_all(rt, "full", toks)
    rt.add_request("inc", 40)
    rows = [rt.prefill({"inc": toks[:30]})] + [rt.decode({"inc": t}) for t in toks[30:]]
    assert_close_rel(torch.cat(rows), full, 2e-5, "decode vs prefill (fp32)")


@pytest.mark.parametrize("preset", ["k31-tiny", "kimi-linear-tiny"])
def test_verify_equals_decode(tiny, preset):
    cfg, rt = _runtime(tiny, preset, torch.float64)
    toks = _prompt(cfg, 30, seed=3)
    rt.add_request("d", 40)
    rt.add_request("v", 40)
    rt.prefill({"d": toks[:18], "v": toks[:18]})
    dec = torch.cat([rt.decode({"d": t}) for t in toks[18:]])
    ver, i = [], 18
    for n in (1, 3, 8):  # drafts of 1..8 tokens per step
        ver.append(rt.verify({"v": toks[i:i + n]}))
        i += n
    assert_close_rel(torch.cat(ver), dec, 1e-9, f"{preset}: verify vs decode")


def test_verify_rejects_more_than_8_tokens(tiny):
    cfg, rt = _runtime(tiny, "k31-tiny")
    rt.add_request("v", 32)
    with pytest.raises(RequestError, match="at most 8 tokens"):
        rt.verify({"v": _prompt(cfg, 9, seed=4)})


def test_chunked_prefill_and_ragged_batch(tiny):
    cfg, rt = _runtime(tiny, "k31-tiny", torch.float64)
    a, b = _prompt(cfg, 37, seed=5), _prompt(cfg, 21, seed=6)
    alone_a, alone_b = _prefill_all(rt, "a", a), _prefill_all(rt, "b", b)
    rt.add_request("a", 40)
    rt.add_request("b", 40)
    first = rt.prefill({"a": a[:20], "b": b[:7]})  # ragged: two requests, different lengths
    second = rt.prefill({"a": a[20:], "b": b[7:]})
    got_a = torch.cat([first[:20], second[:17]])
    got_b = torch.cat([first[20:], second[17:]])
    assert_close_rel(got_a, alone_a, 1e-9, "request a chunked and batched")
    assert_close_rel(got_b, alone_b, 1e-9, "request b chunked and batched")


@pytest.mark.parametrize("preset", ["k31-tiny", "kimi-linear-tiny"])
def test_causality(tiny, preset):
    cfg, rt = _runtime(tiny, preset, torch.float64)
    toks = _prompt(cfg, 32, seed=7)
    changed = list(toks)
    changed[20] = (toks[20] + 1) % cfg.vocab_size
    x, y = _prefill_all(rt, "x", toks), _prefill_all(rt, "y", changed)
    torch.testing.assert_close(y[:20], x[:20], rtol=0, atol=1e-12)  # no earlier logit moves
    assert (y[20:] - x[20:]).abs().max() > 1e-3  # and the change is visible from position 20 on


def test_mxfp4_experts_equal_their_dequantised_values(tiny):
    cfg, module, weights = tiny("k31-tiny-mxfp4")
    assert any(isinstance(w, PackedMXFP4) for w in weights.values())
    plain_cfg = cfg.replace(experts_format="bf16")
    plain = {k: (w.dequantize(torch.float32) if isinstance(w, PackedMXFP4) else w) for k, w in weights.items()}
    toks = _prompt(cfg, 24, seed=8)
    outs = []
    for mod, w in ((module, weights), (build_module(plain_cfg), plain)):
        rt = ReferenceRuntime(mod, w, max_rows=64, max_requests=1)
        outs.append(_prefill_all(rt, "r", toks))
    assert_close_rel(outs[0], outs[1], 1e-6, "MXFP4 experts vs dequantised")


def test_indexer_is_sparse_beyond_topk(tiny):
    """K3.1 (indexer) and K3 (dense) share every weight but the indexer's: they agree while the
    context fits in top-k and differ once it does not."""
    cfg, module, weights = tiny("k31-tiny")
    k3_cfg, k3_module, _ = tiny("k3-tiny")
    k3_weights = {k: w for k, w in weights.items() if ".indexer." not in k}
    toks = _prompt(cfg, 40, seed=9)
    a = _prefill_all(ReferenceRuntime(module, weights, max_rows=64, max_requests=1), "r", toks)
    b = _prefill_all(ReferenceRuntime(k3_module, k3_weights, max_rows=64, max_requests=1), "r", toks)
    topk = cfg.index_topk
    assert_close_rel(a[:topk], b[:topk], 1e-5, "dense while context <= top-k")
    assert (a[topk:] - b[topk:]).abs().max() > 1e-4


def test_runtime_rejects_bad_steps(tiny):
    cfg, rt = _runtime(tiny, "k31-tiny", rows=64, requests=2)
    rt.add_request("a", 8)
    with pytest.raises(RequestError) as e:
        rt.prefill({"a": [1, 2, cfg.vocab_size], "zzz": [1]})
    assert "outside the vocabulary" in str(e.value) and "unknown request 'zzz'" in str(e.value)
    with pytest.raises(RequestError, match="exceed its capacity 8"):
        rt.prefill({"a": list(range(9))})
    with pytest.raises(RequestError, match="at most 1 tokens"):
        rt.step("decode", {"a": [1, 2]})
    with pytest.raises(RequestError, match="300 tokens need 5 cache blocks of 64 rows: needs 5 free cache blocks"):
        rt.add_request("b", 300)
    with pytest.raises(RequestError, match="exceed the model context"):
        rt.add_request("c", cfg.max_position_embeddings + 1)


@pytest.mark.parametrize("fmt", ["f8e4m3", "nvfp4"])
def test_quantised_latent_cache_stores_exactly_the_format_codes(fmt):
    """BuildOptions(latent_cache_dtype=fp8 | nvfp4): the first MLA layer's pool rows are exactly the format's
    encoding (e4m3 saturating; NVFP4 c_KV + E4M3 block scales + e4m3 k_pe, per-layer scales 1) of what the
    f32-cache model stores there (nothing before that layer differs)."""
    from ir import formats
    from ir.ref.paging import read_rows
    from k31c.model.build import BuildOptions, build_module
    from k31c.model.init_weights import random_weights
    from k31c.model.presets import get_preset
    from k31c.runtime.reference import ReferenceRuntime

    cfg = get_preset("k31-tiny")
    w = random_weights(cfg, 0)
    first_mla = next(i for i in range(cfg.num_hidden_layers) if cfg.layer_kind(i) == "mla")
    pools, logits = {}, {}
    for dt in ("f32", fmt):
        rt = ReferenceRuntime(build_module(cfg, BuildOptions(act_dtype="f32", latent_cache_dtype=dt, block_size=4)),
                              w, max_rows=32, max_requests=1)
        rt.add_request("a", 12)
        logits[dt] = rt.prefill({"a": list(range(3, 14))})
        rows = torch.tensor(rt.blocks_of("a")).repeat_interleave(4) * 4 + torch.arange(4).repeat(3)
        pools[dt] = read_rows(rt.pools[f"latent.{first_mla}"], rows[:11], 4)  # a block view of the packed pool
    if fmt == "f8e4m3":
        assert pools[fmt].dtype == torch.float8_e4m3fn
        want = pools["f32"].clamp(-448, 448).to(torch.float8_e4m3fn).view(torch.uint8)
    else:
        assert pools[fmt].dtype == torch.uint8 and pools[fmt].shape[1] == cfg.kv_lora_rank * 9 // 16 + cfg.qk_rope_head_dim
        want = formats.quantize_latent_nvfp4(pools["f32"], cfg.kv_lora_rank)
    assert torch.equal(pools[fmt].view(torch.uint8), want)
    err = ((logits[fmt] - logits["f32"]).norm() / logits["f32"].norm()).item()
    assert 0 < err < 0.5, err   # really quantised; random tiny weights amplify rounding (README: bf16 storage 0.48)
