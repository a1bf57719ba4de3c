"""`fused.mla_query` kernel (codegen/triton/mla_query.py) vs the fused node's unfused body run by the
reference interpreter, on the nodes the pass pipeline builds for k31-tiny: every latent pool format
that reaches the op (f8e4m3, bf16, f32; NVFP4 is never fused), flat pools and strided block views,
ragged requests with positions across block boundaries, pool rows outside the written slots unchanged;
and the compile of k31-tiny and of the one-GPU rank preset selecting the template (no fallback).
CPU: Triton interpreter, fp32, tiny shapes."""

from __future__ import annotations

import functools
import os
import sys
from types import SimpleNamespace

import pytest
import torch

from codegen.registry import templates_for
from codegen.select import select_kernels
from ir.core import Module
from ir.interpreter import Interpreter
from k31c.model.build import BuildOptions, build_module
from k31c.model.presets import get_preset
from passes.base import PassContext
from passes.pipeline import run_pipeline
from tests.helpers import assert_close_rel, paged_row, scattered_table

MLA_QUERY = templates_for("fused.mla_query")[0]
BS = 4


@functools.lru_cache(maxsize=None)
def _module(latent: str, view: str, cfg_name: str = "k31-tiny"):
    if cfg_name == "rank":
        sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benches"))
        from bench_runtime_gpu import rank_config
        cfg = rank_config()
    else:
        cfg = get_preset(cfg_name)
    m = build_module(cfg, BuildOptions(latent_cache_dtype=latent, block_size=BS, pool_view=view))
    run_pipeline(m, PassContext(target="cpu"))
    return m


def _node(latent: str, view: str, fn: str):
    return next(n for n in _module(latent, view).function(fn).nodes if n.op == "fused.mla_query")


def _pool(node, num_blocks: int, g):
    """A pool filled with random values (FP8: their e4m3 codes): flat, or a block view whose block stride
    exceeds bs * W (a page of a packed block row)."""
    t = node.inputs[4].type
    w = int(t.shape[-1])
    vals = torch.randn(num_blocks, BS, w + 3, generator=g)[:, :, :w]  # strided: block stride BS*(W+3)
    if t.dtype.name == "f8e4m3":
        vals = vals.clamp(-448, 448).to(torch.float8_e4m3fn)
    return vals if t.rank == 3 else vals.reshape(num_blocks * BS, w)


def _case(node, lengths, starts, g):
    """Operands for requests r writing positions starts[r] .. lengths[r]-1 (a ragged batch), c_q and
    kv_a column views of wider projections (strided rows, as a packed projection produces)."""
    tbl, nblocks = scattered_table(lengths, BS, seed=int(torch.randint(0, 1000, (1,), generator=g)))
    req = torch.cat([torch.full((n - s,), r, dtype=torch.int64) for r, (n, s) in enumerate(zip(lengths, starts))])
    pos = torch.cat([torch.arange(s, n, dtype=torch.int64) for n, s in zip(lengths, starts)])
    T = req.numel()
    H, dn, dr, kv = (node.attrs[k] for k in ("heads", "nope_dim", "rope_dim", "kv_lora_rank"))
    ql = int(node.inputs[0].type.shape[1])
    c_q = torch.randn(T, ql + 5, generator=g)[:, :ql]
    q_b = torch.randn(H * (dn + dr), ql, generator=g) / ql ** 0.5
    kv_a = (torch.randn(T, kv + dr + 7, generator=g) * 3)[:, 2:2 + kv + dr]
    kv_norm_w = 1 + 0.5 * torch.randn(kv, generator=g)
    return [c_q, q_b, kv_a, kv_norm_w, _pool(node, nblocks, g), req, pos, tbl]


def _written_rows(ops) -> list[int]:
    req, pos, tbl = ops[5], ops[6], ops[7]
    return [paged_row(tbl, BS, int(r), int(p)) for r, p in zip(req, pos)]


def _rows(pool):
    return pool.reshape(-1, pool.shape[-1])


def _check_pool(got, want, written, fp8: bool):
    got, want = _rows(got), _rows(want)
    other = [i for i in range(got.shape[0]) if i not in set(written)]
    if fp8:
        gb, wb = got.view(torch.uint8), want.view(torch.uint8)
        assert torch.equal(gb[other], wb[other]), "pool rows outside the written slots changed"
        diff = (gb[written].to(torch.int16) - wb[written].to(torch.int16)).abs()
        # the same fp32 math summed in another order: a value within rounding of an e4m3 tie may take the
        # neighbouring code, nothing else may differ
        assert int(diff.max()) <= 1 and int((diff > 0).sum()) <= max(1, diff.numel() // 500), \
            f"{int((diff > 0).sum())} of {diff.numel()} latent bytes differ (max {int(diff.max())} codes)"
        assert_close_rel(got[written].float(), want[written].float(), 2e-2, "fp8 latent rows")
    else:
        assert torch.equal(got[other], want[other]), "pool rows outside the written slots changed"
        assert_close_rel(got[written], want[written], 1e-5, "latent rows")


def _run_both(node, ops):
    ref_ops = [o.clone() if i == 4 else o for i, o in enumerate(ops)]
    want = Interpreter(Module("body"), {}).run(node.body, ref_ops)
    attrs = {**node.attrs, "batch_invariant": False}
    got = MLA_QUERY.launch(SimpleNamespace(operands=ops), attrs, MLA_QUERY.heuristic(
        MLA_QUERY.key_dims(SimpleNamespace(operands=ops), attrs), "cpu"))
    return got, want


@pytest.mark.parametrize("latent", ["f8e4m3", "bf16", "f32"])
@pytest.mark.parametrize("view", ["blocks", "flat"])
@pytest.mark.parametrize("fn,lengths,starts", [
    ("prefill", (11, 3, 6), (0, 0, 2)),   # chunks crossing block boundaries, one request a partial chunk
    ("decode", (9, 1, 4, 13), (8, 0, 3, 12)),  # one token per request: first/last slot of a block
])
def test_mla_query_matches_unfused_body(latent, view, fn, lengths, starts):
    node = _node(latent, view, fn)
    g = torch.Generator().manual_seed(hash((latent, view, fn)) % 10_000)
    ops = _case(node, lengths, starts, g)
    pool_in = ops[4]
    (q_nope, q_pe, pool), (w_nope, w_pe, w_pool) = _run_both(node, ops)
    assert pool is pool_in, "the latent pool must be updated in place and returned"
    assert_close_rel(q_nope, w_nope, 1e-5, "q_nope")
    assert_close_rel(q_pe, w_pe, 1e-5, "q_pe")
    assert q_nope.untyped_storage().data_ptr() == q_pe.untyped_storage().data_ptr(), "one buffer for both"
    assert q_nope.is_contiguous() and q_pe.is_contiguous(), "the attention reads q_nope / q_pe without a copy"
    _check_pool(pool, w_pool, _written_rows(ops), latent == "f8e4m3")


@pytest.mark.parametrize("config", [
    {"GEMV": 1, "BLOCK_M": 8, "BLOCK_N": 8, "BLOCK_K": 64, "BLOCK_R": 1, "num_warps": 4, "num_stages": 1},
    {"GEMV": 1, "BLOCK_M": 1, "BLOCK_N": 32, "BLOCK_K": 128, "BLOCK_R": 4, "num_warps": 4, "num_stages": 1},
    {"GEMV": 0, "BLOCK_M": 16, "BLOCK_N": 32, "BLOCK_K": 32, "BLOCK_R": 2, "num_warps": 4, "num_stages": 1},
])
def test_mla_query_configs(config):
    """The dot-free decode tile (GEMV=1, one row or several) and small tensor-core tiles give the same
    results; q_lora = 96 is not a multiple of BLOCK_K = 64 (masked K tail)."""
    node = _node("f8e4m3", "blocks", "decode")
    ops = _case(node, (9, 1, 4), (8, 0, 3), torch.Generator().manual_seed(config["BLOCK_N"]))
    ref_ops = [o.clone() if i == 4 else o for i, o in enumerate(ops)]
    w_nope, w_pe, w_pool = Interpreter(Module("body"), {}).run(node.body, ref_ops)
    key = MLA_QUERY.key_dims(SimpleNamespace(operands=ops), {**node.attrs, "batch_invariant": False})
    assert MLA_QUERY.constraints(config, key, "h200") == []
    q_nope, q_pe, pool = MLA_QUERY.launch(SimpleNamespace(operands=ops), dict(node.attrs), config)
    assert_close_rel(q_nope, w_nope, 1e-5, "q_nope")
    assert_close_rel(q_pe, w_pe, 1e-5, "q_pe")
    _check_pool(pool, w_pool, _written_rows(ops), True)


def test_heuristics_are_legal():
    for T in (1, 3, 8, 16, 17, 64, 65, 8192):
        for bi in (0, 1):
            key = {"T": T, "N": 2304, "K": 1536, "KV": 512, "DR": 64, "x": "bf16", "w": "bf16", "pool": "f8e4m3",
                   "bi": bi}
            for target in ("h200", "cpu"):
                cfg = MLA_QUERY.heuristic(key, target)
                assert MLA_QUERY.constraints(cfg, key, target) == [], (T, bi, target, cfg)
                assert set(cfg) == {t.name for t in MLA_QUERY.tunables}
                assert all(cfg[t.name] in t.values for t in MLA_QUERY.tunables), cfg


def test_fp8_latent_saturates_and_rounds_like_the_cast():
    """Large k_pe values saturate to +-448, tiny ones land on subnormal codes, as `cast` to f8e4m3 does."""
    node = _node("f8e4m3", "flat", "decode")
    g = torch.Generator().manual_seed(3)
    ops = _case(node, (5, 2), (4, 1), g)
    kv = node.attrs["kv_lora_rank"]
    ops[2] = ops[2].clone()
    ops[2][:, kv:] = torch.randn(ops[2].shape[0], ops[2].shape[1] - kv, generator=g) * torch.tensor(
        [1000.0, 3e-3] * ((ops[2].shape[1] - kv) // 2))
    (_, _, pool), (_, _, w_pool) = _run_both(node, ops)
    rows = _written_rows(ops)
    assert torch.equal(pool.view(torch.uint8)[rows, kv:], w_pool.view(torch.uint8)[rows, kv:]), "k_pe bytes"
    assert pool[rows, kv:].float().abs().max() == 448.0


def test_batch_invariant_rows():
    """Under batch_invariant a token's q and latent row are bitwise the same alone and inside a batch."""
    node = _node("f32", "flat", "prefill")
    ops = _case(node, (6, 5), (0, 1), torch.Generator().manual_seed(5))
    attrs = {**node.attrs, "batch_invariant": True}
    cfg = MLA_QUERY.heuristic(MLA_QUERY.key_dims(SimpleNamespace(operands=ops), attrs), "cpu")
    q_all, _, pool = MLA_QUERY.launch(SimpleNamespace(operands=ops), attrs, cfg)
    t = 4
    one = [o[t:t + 1] if i in (0, 2, 5, 6) else o for i, o in enumerate(ops)]
    one[4] = torch.zeros_like(ops[4])
    q_one, _, pool_one = MLA_QUERY.launch(SimpleNamespace(operands=one), attrs, cfg)
    row = _written_rows(ops)[t]
    assert torch.equal(q_one[0], q_all[t]) and torch.equal(pool_one[row], pool[row])


def test_bad_operands_are_named():
    node = _node("f32", "flat", "decode")
    ops = _case(node, (3,), (2,), torch.Generator().manual_seed(1))
    ops[1] = ops[1][:-1]
    with pytest.raises(ValueError, match="q_b"):
        MLA_QUERY.launch(SimpleNamespace(operands=ops), dict(node.attrs), MLA_QUERY.heuristic(
            MLA_QUERY.key_dims(SimpleNamespace(operands=ops), dict(node.attrs)), "cpu"))


@pytest.mark.parametrize("cfg_name", ["k31-tiny", "rank"])
@pytest.mark.parametrize("latent", ["f8e4m3", "bf16"])
def test_compile_selects_mla_query(cfg_name, latent):
    m = _module(latent, "blocks", cfg_name)
    for target in ("h200", "cpu"):
        choices = [c for c in select_kernels(m, target) if c.op == "fused.mla_query"]
        assert choices and all(c.kernel == "mla_query" for c in choices), \
            f"{cfg_name}/{latent}/{target}: {[(c.function, c.reason) for c in choices if c.template is None]}"


_SM90_COMPILE = r'''
import os
os.environ["TRITON_INTERPRET"] = "0"
import torch
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource, compile as tc
from codegen.aot.record import Recorder
from codegen.triton.mla_query import mla_query
target = GPUTarget("cuda", 90, 32)
T, H, dn, dr, kv, K = 2, 4, 128, 64, 512, 256
ops = [torch.zeros(T, K, dtype=torch.bfloat16), torch.zeros(H * (dn + dr), K, dtype=torch.bfloat16),
       torch.zeros(T, kv + dr, dtype=torch.bfloat16), torch.zeros(kv, dtype=torch.bfloat16),
       torch.zeros(64, kv + dr, dtype=torch.float8_e4m3fn), torch.zeros(T, dtype=torch.int64),
       torch.zeros(T, dtype=torch.int64), torch.zeros(1, 4, dtype=torch.int32)]
attrs = dict(heads=H, nope_dim=dn, rope_dim=dr, kv_lora_rank=kv, eps=1e-6, block_size=16)
for gemv in (0, 1):
    cfg = dict(GEMV=gemv, BLOCK_M=1 if gemv else 16, BLOCK_N=4 if gemv else 64, BLOCK_K=256, BLOCK_R=4,
               num_warps=4, num_stages=1)
    with Recorder(target) as rec:
        mla_query(ops, attrs, cfg)
    for spec in rec.specs.values():
        fn, sig, cx, at, opts = spec.compile_args
        print(gemv, len(tc(ASTSource(fn, sig, cx, at), target=target, options=dict(vars(opts))).asm["ptx"]) > 0)
'''


def test_kernel_compiles_for_sm90():
    """The interpreter runs each branch on its own; the compiler types both (session 10: a name reused across the
    latent-row and q-tile branches with different shapes ran on the CPU and failed on the H200). Both tiles
    (GEMV 0 / 1) with an FP8 pool, compiled to PTX for sm_90 in a subprocess through the AOT recorder."""
    import os
    import subprocess
    import sys
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    p = subprocess.run([sys.executable, "-c", _SM90_COMPILE], env=dict(os.environ, TRITON_INTERPRET="0", PYTHONPATH=repo),
                       capture_output=True, text=True, timeout=240, cwd=repo)
    assert p.returncode == 0, p.stderr[-3000:]
    assert p.stdout.split() == ["0", "True", "1", "True"], p.stdout
