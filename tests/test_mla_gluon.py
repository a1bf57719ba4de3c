"""ORIENT 3 of the sparse MLA decode (_mla_gluon.py, Gluon, CUDA sm_90) checked without a GPU (Gluon kernels do not
run in the Triton interpreter): the launcher's ORIENT 3 launches recorded for sm_90 by the AOT recorder
(codegen.aot.record: the real JIT's specialisations, nothing launched) and compiled, the wgmmas asynchronous (ptxas did
not serialise them: one wait per step, none after each wgmma), the query split emulated in float64, the choice of
target, and the dispatch falling back to ORIENT 2 off CUDA. The kernel's bf16 results are checked on the H200 by
benches/bench_mla_b64.py (vs float64 incl. -1 entries, short contexts, an empty token and positions through the block
table; graph replay == eager).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch

from codegen.triton import _mla_gluon as glu
from codegen.triton.mla_sparse import sparse_latent_attention
from tests.helpers import TR36, skip_without_triton36

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

_SM90_BUILD = textwrap.dedent("""
    import os, sys, json, subprocess, tempfile
    os.environ["TRITON_INTERPRET"] = "0"
    sys.path.insert(0, sys.argv[1])
    import torch, triton
    from triton.backends.compiler import GPUTarget
    from codegen.aot.record import Recorder
    from codegen.triton import mla_sparse
    from codegen.triton.mla_sparse import heuristic, sparse_latent_attention
    target = GPUTarget("cuda", 90, 32)
    T, H, KV, DR, L = 2, 12, 512, 64, 2048    # CPU tensors stand in for CUDA ones (nothing is launched)
    q = torch.randn(T, H, KV).to(torch.bfloat16)
    qp = torch.randn(T, H, DR).to(torch.bfloat16)
    pool = torch.zeros(64, KV + DR, dtype=torch.float8_e4m3fn)
    sel = torch.randint(0, 64, (T, L))
    key = {"H": H, "L": 2048, "KV": KV, "fmt": 1, "sparse": 1, "bi": 0}
    with Recorder(target) as rec:     # the batch-64 and batch-8 defaults (3 stages, pieces merged in the launch / 2)
        base = mla_sparse.FOLD_PIECES
        for cfg, limit in ((heuristic(dict(key, T=64), "h200"), base), (heuristic(dict(key, T=8), "h200"), base),
                           (dict(heuristic(dict(key, T=1), "h200"), CHUNK=64, FOLD=1), 32)):
            mla_sparse.FOLD_PIECES = limit    # 32: the third build only, a merge of 32 pieces (the launcher's is lower)
            sparse_latent_attention(q, qp, pool, torch.full((T,), L - 1), None, 0.1, sel, latent_format="fp8",
                                    latent_scale=0.5, config=cfg, block_size=64, out_dtype=torch.bfloat16)
    seen = []
    BIN = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
    for spec in rec.specs.values():
        fn, sig, cx, attrs, opts = spec.compile_args
        if fn.fn.__name__ != "_mla_gluon_kernel":
            continue
        k = triton.compile(fn.ASTSource(fn, sig, cx, attrs), target=target, options=dict(vars(opts)))
        with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
            f.write(k.asm["cubin"])
            f.flush()
            sass = subprocess.run([os.path.join(BIN, "cuobjdump"), "-sass", f.name], capture_output=True,
                                  text=True).stdout
        ptx = k.asm["ptx"]
        seen.append({"wgmma": ptx.count("wgmma.mma_async"), "wgmma_wait": ptx.count("wgmma.wait_group"),
                     "sass_wait": sass.count("WARPGROUP.DEPBAR"), "cp_async": ptx.count("cp.async.cg.shared.global"),
                     "atomics": [ptx.count("atom.global.gpu.acq_rel.add"), ptx.count("atom.global.gpu.relaxed.exch")],
                     "stages": cx[(fn.arg_names.index("STAGES"),)], "fold": cx[(fn.arg_names.index("FOLD"),)],
                     "local": sass.count("STL") + sass.count("LDL"),
                     "shared": k.metadata.shared, "num_warps": opts.num_warps, "pdl": ptx.count("griddepcontrol.wait"),
                     "launch_pdl": bool(vars(opts).get("launch_pdl")), "triton": triton.__version__})
    print(json.dumps(seen))
""")


def _build(extra_path=None):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    if extra_path:
        env["PYTHONPATH"] = extra_path
    r = subprocess.run([sys.executable, "-c", _SM90_BUILD, ROOT], capture_output=True, text=True, env=env,
                       timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads(r.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("tr36", [False, True])
def test_orient3_launch_binds_and_compiles_async_for_sm90(tr36):
    """The launcher's ORIENT 3 launches recorded for sm_90 by the AOT recorder (the heuristic's batch-64 config, 3
    stages, merging its 2 pieces in the launch: FOLD, and batch-8 config, 2 stages, 16 pieces) compile: 18 fp8 logits
    wgmmas a step (kv / 32 and dr / 32 K steps of the concatenated query, N = 32) and 32 fp16 value wgmmas with A in
    registers (4 column groups x 2 M blocks x 4 K steps), one wait for each in the loop and not serialised by ptxas
    (the SASS has no wait after each wgmma), no spill; the rows by cp.async (16 B: a thread's share of 64 rows of 576
    bytes, per row buffer filled); one PDL wait; FOLD: the arrival counter taken acq_rel and reset (one atomic each).
    A third build merges 32 pieces (batch 1, CHUNK 64; allowed here only) without a spill: the merge tile's layout
    follows its column count (`_mla_gluon.layouts`; a fixed one held 8x the registers there and spilled)."""
    skip_without_triton36(tr36)
    seen = _build(f"{TR36}:{ROOT}" if tr36 else None)
    assert sorted((r["stages"], r["fold"]) for r in seen) == [(2, False), (2, True), (3, True)], seen
    for r in seen:
        stages, fold = r["stages"], r["fold"]
        assert r["triton"].startswith("3.6" if tr36 else "3.7"), r
        assert r["atomics"] == [int(fold)] * 2, r
        assert r["wgmma"] == 50 and r["wgmma_wait"] == 2 and r["sass_wait"] == 2 and r["local"] == 0, r
        assert r["cp_async"] == stages * (64 * 576 // 16) // 128, r
        assert r["num_warps"] == 4 and r["pdl"] == 1 and r["launch_pdl"], r
        assert r["shared"] <= (113 if stages == 2 else 227) * 1024, r


def test_query_split_is_exact_in_float64():
    """_split_store's bit rounding (q -> hi on 4 significant bits, lo = q - hi) emulated on bf16 queries scaled as the
    kernel scales them (row maximum in [2^7, 2^8)): hi is an e4m3 value, and the two e4m3 parts sum to q exactly
    where lo's last bit is not below e4m3's subnormal step 2^-9 (|q| >= 2^-2), within 2^-9 elsewhere (both parts
    rounded to that step)."""
    g = torch.Generator().manual_seed(int(torch.randint(0, 2 ** 31, ()).item()))
    q = (torch.randn(16, 576, generator=g) * torch.exp2(torch.randint(-12, 4, (16, 576), generator=g).float()))
    q = q.to(torch.bfloat16).float()
    q[3] = 0.0
    amax = q.abs().amax(1)
    e = ((amax.view(torch.int32) >> 23) & 255) - 127
    n = (7 - e).clamp(-126, 126)
    qs = q * torch.exp2(n.float())[:, None]
    assert float(qs.abs().max()) < 256
    b = qs.view(torch.int32)
    hi = ((b + 0x7FFFF + ((b >> 20) & 1)) & -0x100000).view(torch.float32)
    h8, l8 = hi.to(torch.float8_e4m3fn).double(), (qs - hi).to(torch.float8_e4m3fn).double()
    assert not torch.isnan(h8 + l8).any()
    big = qs.abs() >= 0.25
    assert big.sum() > 1000 and (~big).sum() > 100
    assert torch.equal(h8[big], hi.double()[big])
    assert torch.equal((h8 + l8)[big], qs.double()[big])
    assert float((h8 + l8 - qs.double()).abs().max()) <= 2.0 ** -9


@pytest.mark.parametrize("T, fallback", [(2, dict(ORIENT=1, BLOCK_N=32, num_stages=1, F16=1)),
                                         (32, dict(ORIENT=2, KB=128, num_stages=3))])
def test_orient3_falls_back_off_cuda(T, fallback):
    """On CPU (the interpreter) ORIENT 3 is never usable: the launcher runs the same split with ORIENT 1 while tokens x
    head blocks < 32, else ORIENT 2, and the pieces merged by the combine launch (FOLD dropped): the result bitwise
    that of the fallback's own config."""
    g = torch.Generator().manual_seed(int(torch.randint(0, 2 ** 31, ()).item()))
    H, KV, DR, N, L = 12, 64, 16, 96, 80
    q = torch.randn(T, H, KV, generator=g).to(torch.bfloat16)
    qp = torch.randn(T, H, DR, generator=g).to(torch.bfloat16)
    pool = (torch.randn(N, KV + DR, generator=g) * 4).to(torch.float8_e4m3fn)
    sel = torch.randint(-1, N, (T, L), generator=g)
    assert not glu.usable(q, pool, sel, 1, 16, 64)
    base = dict(BLOCK_H=16, BLOCK_N=64, num_warps=4, PREFETCH=1, CHUNK=64)
    kw = dict(latent_format="fp8", latent_scale=0.5, block_size=1)
    o3, l3 = sparse_latent_attention(q, qp, pool, torch.full((T,), L - 1), None, 0.2, sel,
                                     config=dict(base, ORIENT=3, num_stages=2, FOLD=1), **kw)
    of, lf = sparse_latent_attention(q, qp, pool, torch.full((T,), L - 1), None, 0.2, sel,
                                     config=dict(base, **fallback), **kw)
    assert not torch.isnan(o3).any() and o3.abs().sum() > 0
    assert torch.equal(o3, of) and torch.equal(l3, lf)


def test_fold_is_orient3s_for_a_few_pieces():
    """FOLD 1 (pieces merged in the attention launch) asked of another orientation is refused with the reason."""
    T, H, KV, DR, N, L = 1, 12, 64, 16, 96, 80
    q, qp = torch.randn(T, H, KV), torch.randn(T, H, DR)
    pool = torch.randn(N, KV + DR).to(torch.float8_e4m3fn)
    sel = torch.randint(0, N, (T, L))
    cfg = dict(ORIENT=1, BLOCK_H=16, BLOCK_N=32, CHUNK=32, num_warps=4, num_stages=1, PREFETCH=1, FOLD=1)
    with pytest.raises(ValueError, match="FOLD 1 .* ORIENT 3's, for at most 4 pieces"):
        sparse_latent_attention(q, qp, pool, torch.full((T,), L - 1), None, 0.2, sel, latent_format="fp8",
                                config=cfg, block_size=1)


def test_usable_only_on_cuda_sm90(monkeypatch):
    """ORIENT 3 is chosen only where Triton builds for CUDA sm_90 (wgmma is Hopper's: not sm_80, sm_100, HIP), for an
    FP8 pool read through a selection in pieces of at most 1024 rows (the row table's shared memory)."""
    from triton.backends.compiler import GPUTarget
    from triton.runtime import driver

    class _Target:          # only the build target is read
        def __init__(self, target):
            self.target = target

        def get_current_target(self):
            return self.target

    q = torch.zeros(1, 12, 512, dtype=torch.bfloat16)
    pool = torch.zeros(8, 576, dtype=torch.float8_e4m3fn)
    sel = torch.zeros(1, 64, dtype=torch.int64)
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    got = []
    for target in (GPUTarget("cuda", 90, 32), GPUTarget("cuda", 100, 32), GPUTarget("cuda", 80, 32),
                   GPUTarget("hip", "gfx942", 64)):
        monkeypatch.setattr(driver, "_active", _Target(target))   # restored after the test
        got.append(glu.usable(q, pool, sel, 1, 16, 1024))
        if target.arch == 90:
            got.append([glu.usable(q, pool, sel, 1, 16, 2048), glu.usable(q, pool, None, 1, 16, 1024),
                        glu.usable(q, pool, sel, 0, 16, 1024), glu.usable(q, pool, sel, 1, 32, 1024),
                        glu.usable(q[..., :384], pool[:, 128:], sel, 1, 16, 1024)])
    assert got == [True, [False] * 5, False, False, False]


def test_value_column_relabelling_is_sigma():
    """`_value_a`'s relabelling of a column group (columns as bits [4, 8, C / 2, 2], reordered (2, 0, 3, 1)) is
    `_sigma`, the columns the epilogue stores the value accumulator's rows to: a permutation of the group (kv 256 and
    512: groups of 64 and 128 columns)."""
    for kg in (64, 128):
        c = kg // 32
        want = torch.arange(kg).reshape(4, 8, c // 2, 2).permute(2, 0, 3, 1).reshape(kg)
        got = glu._sigma.fn(torch.arange(kg), kg)
        assert torch.equal(got, want) and torch.equal(got.sort().values, torch.arange(kg))
        assert not torch.equal(got, torch.arange(kg))
