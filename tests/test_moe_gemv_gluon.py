"""The Gluon tensor-core gate-up of the per-pair decode path (_moe_gemv_gluon.py, config GLUON=1), checked without a
GPU (Gluon kernels do not run in the Triton interpreter): the word decode text emulated instruction by instruction,
the kernel's K permutation and slice reduction replayed in float64 with the same index expressions, the kernel
compiled ahead of time for sm_90 (mma.sync fed from registers, 16-byte weight loads, no per-step shared memory, one
PDL wait), and the dispatch never choosing it off CUDA. The real kernel's bf16 results are checked on the H200 by
benches/bench_moe.py (decode section, vs the float64 reference, graph replay bitwise equal to eager).
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import torch

from codegen.triton import _moe_configs as cfgs, _moe_gemv as gv, _moe_gemv_gluon as glu
from ir.formats import quantize_mxfp4
from ir.packed import PackedMXFP4
from tests.helpers import TR36, TR36_REASON, skip_without_triton36
from tests.test_moe_kernels_gpu_paths import _run_ptx

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PI = [0, 4, 1, 5, 2, 6, 3, 7]           # logical i of a word's 8 values -> its code (column 8q + PI[i])


def _bf16(bits: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(bits.astype(np.int32).astype(np.int16)).view(torch.bfloat16).double()


def _word_values(words: np.ndarray, s: int, wide: bool) -> torch.Tensor:
    """The kernel's 8 A-operand values of each int32 word in logical order i (asm output register i // 2, half
    i % 2), by emulating WORD_ASM(_WIDE) on the words under scale byte s."""
    f = s << 7 if wide else (s + 126) << 7
    out = _run_ptx(str((glu.WORD_ASM_WIDE if wide else glu.WORD_ASM).value),
                   {"$4": words, "$12": np.uint32(f | (f << 16))})
    return torch.stack([_bf16((out[f"${i // 2}"] >> (16 * (i % 2))) & 0xFFFF) for i in range(8)], 1)


@pytest.mark.parametrize("wide", [False, True])
def test_word_asm_is_exact_for_every_half_word(wide):
    """WORD_ASM (the four E2M1_ASM16 texts renamed onto one word) gives value i = code PI[i] of the word times the
    block scale, exactly, for every 16-bit pattern in each half, scale bytes 2^-127 .. 2^127 (WIDE: up to 254)."""
    lo = np.arange(1 << 16, dtype=np.uint32)
    hi = np.random.default_rng(int(torch.randint(0, 2 ** 31, ()).item())).permutation(lo).astype(np.uint32)
    words = lo | (hi << 16)
    for s in [1, 60, 120, 128] + ([129, 200, 254] if wide else [0]):
        got = _word_values(words, s, wide)
        packed = torch.from_numpy(words.view(np.uint8).copy()).view(-1, 16)         # 4 words: one 32-column block
        ref = PackedMXFP4(packed, torch.full((packed.shape[0], 1), s, dtype=torch.uint8)).dequantize(torch.float64)
        ref = ref.reshape(-1, 8)[:, PI]
        assert not torch.isnan(got).any()
        assert torch.equal(got, ref), f"scale byte {s}"


def _emulate_gate_up_dots(wq: torch.Tensor, sc: torch.Tensor, z: torch.Tensor, ks: int, nwt: int) -> torch.Tensor:
    """W z (float64) for one 16-row block, the way the kernel forms it: per step, A [16·KS, 32·NWT] from the words
    at _a_offsets' offsets (value i of word NWT·t + j at logical k = 32j + 8t + i), B [32·NWT, 8] from _b_load's
    columns permuted as _b_operand does, C = A B summed over steps, then row r = Σ_w C[16w + r, w]."""
    ell = wq.shape[1] * 8
    kq = ell // ks
    kqw, steps = kq // 8, kq // (32 * nwt)
    words = wq.view(torch.int32).numpy().astype(np.uint32)
    m = torch.arange(16 * ks)[:, None, None]
    j = torch.arange(nwt)[None, :, None]
    t = torch.arange(4)[None, None, :]
    woff = (m // 16) * kqw + nwt * t + j                                             # [M, NWT, 4]
    soff = (m[:, 0] // 16) * (kqw // 4) + (nwt * t[:, 0]) // 4                       # [M, 4]
    n = torch.arange(8)
    q = torch.arange(8)
    wide = bool((sc > 128).any())
    blk = torch.arange(kqw * ks) // 4                                                # a word's scale block
    dec = torch.zeros(16, kqw * ks, 8, dtype=torch.float64)                         # each word's 8 values
    for s in torch.unique(sc).tolist():
        hit = sc[:, blk] == s
        dec[hit] = _word_values(words[hit.numpy()], int(s), wide)
    c = torch.zeros(16 * ks, 8, dtype=torch.float64)
    for st in range(steps):
        wi = woff + st * 4 * nwt                                                     # [M, NWT, 4]
        assert torch.equal(blk[wi], (soff[:, None, :] + st * nwt).expand_as(wi))     # the kernel's scale offsets
        a = dec[(m % 16).expand_as(wi), wi]                                          # [M, NWT, 4, 8]
        a = a.reshape(16 * ks, 32 * nwt)
        jx, tx = torch.arange(nwt)[:, None, None, None], torch.arange(4)[None, :, None, None]
        off = (n[None, None, None, :] % ks) * kq + st * 32 * nwt + 8 * (nwt * tx + jx) + q[None, None, :, None]
        x = z[off].double()
        b = x.reshape(nwt, 4, 2, 4, 8).permute(0, 1, 3, 2, 4).reshape(32 * nwt, 8)
        c += a @ b
    return torch.stack([c[16 * w: 16 * w + 16, w] for w in range(ks)], 0).sum(0)


@pytest.mark.parametrize("ks,nwt", [(4, 4), (2, 2), (8, 1)])
def test_k_permutation_replayed_in_float64_equals_reference(ks, nwt):
    """The kernel's index expressions (weights, scales, activation columns, slice diagonal) replayed in float64
    give W z of the float64 dequantised weights (any misplaced column would show at 1e-3)."""
    g = torch.Generator().manual_seed(int(torch.randint(0, 2 ** 31, ()).item()))
    ell = 2 * ks * 32 * nwt
    w = torch.randn(16, ell, generator=g)
    packed, scales = quantize_mxfp4(w)
    scales[::3, ::2] = torch.randint(129, 135, scales[::3, ::2].shape, generator=g).to(torch.uint8)  # some WIDE
    z = torch.randn(ell, generator=g).to(torch.bfloat16)
    got = _emulate_gate_up_dots(packed.view(torch.int32), scales, z, ks, nwt)
    ref = PackedMXFP4(packed, scales).dequantize(torch.float64) @ z.double()
    assert not torch.isnan(got).any()
    assert torch.allclose(got, ref, rtol=1e-12, atol=1e-9 * ref.abs().max().item())


_AOT = textwrap.dedent("""
    import os, sys, json
    os.environ["TRITON_INTERPRET"] = "0"
    sys.path.insert(0, sys.argv[1])
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource
    from codegen.triton import _moe_gemv_gluon as G
    res = {}
    for ks, nwt, steps, early in ((4, 4, 2, 0), (4, 4, 4, 1), (2, 2, 3, 0)):
        fn = G._gate_up_gluon_kernel
        ce = dict(TOPK=2, ACT=0, HAS_BETA2=True, KS=ks, NWT=nwt, STEPS=steps, WIDE=False, HX=1, EARLY=early,
                  PDL=True, **G.layouts(ks, nwt))
        ptrs = {"z_ptr": "*bf16", "ids_ptr": "*i32", "w1_ptr": "*i32", "w3_ptr": "*i32", "s1_ptr": "*u8",
                "s3_ptr": "*u8", "h_ptr": "*fp32"}
        sig = {a: "constexpr" if a in ce else ptrs.get(a, "fp32" if a.startswith("beta") else "i32")
               for a in fn.arg_names}
        div = {(i,): [["tt.divisibility", 16]] for i, a in enumerate(fn.arg_names)
               if a not in ce and not a.startswith("beta") and a not in ("E", "NP", "INTER", "ELL")}
        k = triton.compile(GluonASTSource(fn, sig, ce, div), target=GPUTarget("cuda", 90, 32),
                           options={"num_warps": ks, "num_stages": 1})
        ptx = k.asm["ptx"]
        res[f"{ks}_{nwt}_{steps}"] = {"mma": ptx.count("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32"),
                                      "v4": ptx.count("ld.global.v4.b32"), "st_shared": ptx.count("st.shared"),
                                      "ld_shared": ptx.count("ld.shared"), "wait": ptx.count("griddepcontrol.wait"),
                                      "launch": ptx.count("griddepcontrol.launch_dependents"),
                                      "triton": triton.__version__}
    print(json.dumps(res))
""")


def _aot(extra_path=None, script=_AOT):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    if extra_path:
        env["PYTHONPATH"] = extra_path
    r = subprocess.run([sys.executable, "-c", script, ROOT], capture_output=True, text=True, env=env, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    import json
    return json.loads(r.stdout.strip().splitlines()[-1])


def test_gate_up_compiles_for_sm90_to_register_fed_mma():
    """sm_90 (Triton 3.7 here; the device runs 3.6): 2 x NWT x 2 mma.sync per step for each of w1, w3 per warp
    (M = 16 rows a K slice), the weights and z in 16-byte loads (NWT = 4), shared memory only in the final
    slice reduction (the same count for 2 and 4 steps), and each PDL instruction once."""
    res = _aot()
    a, b, c = res["4_4_2"], res["4_4_4"], res["2_2_3"]
    assert a["mma"] == 2 * 2 * 4 * 2 and b["mma"] == 2 * 2 * 4 * 4 and c["mma"] == 2 * 2 * 2 * 3, res
    assert a["v4"] == 2 * (2 * 2 + 4) and b["v4"] == 4 * (2 * 2 + 4), res      # per step: 2 rows x w1, w3; z: NWT
    assert a["st_shared"] == b["st_shared"] and a["ld_shared"] == b["ld_shared"] and a["st_shared"] <= 8, res
    for r in res.values():
        assert r["wait"] == 1 and r["launch"] == 1, res


@pytest.mark.skipif(not os.path.isdir(TR36), reason=TR36_REASON)
def test_gate_up_compiles_with_triton_36():
    res = _aot(extra_path=f"{TR36}:{ROOT}")
    assert all(r["triton"].startswith("3.6") for r in res.values()), res
    assert res["4_4_2"]["mma"] == 32 and res["4_4_2"]["v4"] == 16, res


_FAKE_LAUNCH = textwrap.dedent("""
    import os, sys, json
    os.environ["TRITON_INTERPRET"] = "0"
    sys.path.insert(0, sys.argv[1])
    import torch, triton
    from triton.backends.compiler import GPUTarget
    from triton.runtime.driver import driver
    from triton.runtime.jit import JITFunction

    class _Sm90:        # compiles for sm_90, never launches (_do_compile below returns no kernel)
        def get_current_target(self):
            return GPUTarget("cuda", 90, 32)
        def get_current_device(self):
            return 0
        def get_current_stream(self, device=None):
            return 0

    driver.set_active(_Sm90())
    seen = []

    def _do_compile(self, key, signature, device, constexprs, options, attrs, warmup):
        k = triton.compile(self.ASTSource(self, signature, constexprs, attrs), target=GPUTarget("cuda", 90, 32),
                           options=options.__dict__)
        ptx = k.asm["ptx"]
        seen.append({"name": self.__name__, "mma": ptx.count("mma.sync"), "num_warps": options.num_warps,
                     "launch_pdl": bool(options.__dict__.get("launch_pdl")), "wait": ptx.count("griddepcontrol.wait"),
                     "atom": ptx.count("atom."), "triton": triton.__version__})

    JITFunction._do_compile = _do_compile
    from codegen.triton import _moe_gemv_gluon as G
    from codegen.triton._moe_host import _gemv_weight
    from ir.formats import quantize_mxfp4
    from ir.packed import PackedMXFP4
    E, L, I, T, K = 3, 1024, 512, 2, 2
    g = torch.Generator().manual_seed(0)
    ws = [PackedMXFP4(*quantize_mxfp4(torch.randn(E, n, k, generator=g))) for n, k in ((I, L), (L, I), (I, L))]
    g1, g2, g3 = (_gemv_weight(w, n, (E,) + tuple(w.shape[1:]), None, torch.bfloat16)
                  for w, n in zip(ws, ("w1", "w2", "w3")))
    z = torch.randn(T, L).to(torch.bfloat16)
    ids = torch.tensor([[0, 2], [1, 5]], dtype=torch.int32)
    act = dict(betas=(2.0, 3.0), ACT=0, HAS_BETA2=True)
    for cfg in ({"GLUON": 2}, {"GLUON": 2, "GKS": 2, "GNW": 2, "GKS2": 2, "EARLY": 3}):
        h = torch.empty(T * K, I, dtype=torch.bfloat16)
        G.gate_up(z, ids, g1, g3, h, act, cfg)
        G.gate_up(z, ids, g1, g3, h.float(), act, cfg, late=True)
        G.down(h, torch.rand(T, K), ids, g2, torch.empty(T, L), cfg)
    print(json.dumps(seen))
""")


@pytest.mark.parametrize("tr36", [False, True])
def test_host_launches_bind_and_compile_for_sm90(tr36):
    """gate_up / down's launches (arguments, constexpr layouts, warps, PDL options) bound by the real JIT against a
    driver that reports sm_90 and compiled (never launched): w1 and w3 on the tensor cores, LATE drops the
    programmatic edge, the down kernel's slot combine uses the counter atomics; Triton 3.7 and 3.6."""
    skip_without_triton36(tr36)
    seen = _aot(f"{TR36}:{ROOT}" if tr36 else None, _FAKE_LAUNCH)
    assert [r["name"] for r in seen] == ["_gate_up_gluon_kernel"] * 2 + ["_down_gluon_kernel"] + (
        ["_gate_up_gluon_kernel"] * 2 + ["_down_gluon_kernel"]), seen
    assert all(r["triton"].startswith("3.6" if tr36 else "3.7") for r in seen), seen
    assert [r["mma"] for r in seen] == [32, 32, 8, 64, 64, 16], seen              # L/(KS 32 NWT) steps x 2 NWT x 2
    assert [r["num_warps"] for r in seen] == [4, 4, 4, 2, 2, 2], seen
    assert [r["launch_pdl"] for r in seen] == [True, False, True] * 2, seen
    assert all(r["wait"] == 1 for r in seen) and all(r["atom"] >= 2 for r in seen[2::3]), seen


def test_measured_configs_fit_the_model_shapes_and_targets():
    """GLUON_T1 / GLUON_T8 tile the rank preset's experts (l=3584, I=3072) without masks, and pass the constraints
    on the H200 (sm_90) only."""
    key = {"MX": True, "BF16": True}
    base = {**cfgs.BATCH_INVARIANT_CONFIG, "DEQ": "asm16", "PATH": "gemv", **cfgs.GEMV_T1}
    for g in (glu.GLUON_T1, glu.GLUON_T8):
        assert glu._fits(3584, 3072, glu.tiles(g)) and glu._fits(3072, 3584, glu.tiles(g, True))
        assert cfgs.constraints({**base, **g}, key, {"compute_capability": (9, 0)}) == []
        assert any("GLUON" in m for m in cfgs.constraints({**base, **g}, key, {"compute_capability": (8, 0)}))
    assert not glu._fits(3584, 3072, (8, 4)) and not glu._fits(3584, 3000, (4, 4))


def test_gluon_never_chosen_off_cuda():
    """GLUON=1 is rejected by the constraints without a CUDA sm_90 target, and gemv_experts on CPU falls back to the
    GV=2 kernels (same bits as without the key)."""
    key = {"MX": True, "BF16": True}
    base = {**cfgs.BATCH_INVARIANT_CONFIG, "DEQ": "bytes", "PATH": "gemv", **cfgs.GEMV_T1}
    assert any("GLUON" in m for m in cfgs.constraints({**base, "GLUON": 1}, key, None))
    assert not any("GLUON" in m for m in cfgs.constraints(base, key, None))
    g = torch.Generator().manual_seed(int(torch.randint(0, 2 ** 31, ()).item()))
    E, L, I = 4, 64, 32
    ws = [PackedMXFP4(*quantize_mxfp4(torch.randn(E, n, k, generator=g) / k ** 0.5))
          for n, k in ((I, L), (L, I), (I, L))]
    z = torch.randn(1, L, generator=g)
    ids = torch.tensor([[1, 3]], dtype=torch.int32)
    wt = torch.tensor([[0.6, 0.4]])
    cfg = {"GV": 2, "GN": 4, "GK": 32, "GN2": 4, "GK2": 32, "GW2": 1, "XV": 1, "HX": 1, "num_warps": 1}
    assert not glu.usable(z, (True, ws[0].packed.view(torch.int32)), (True, None), {**cfg, "GLUON": 1})
    y0 = gv.gemv_experts(z, wt, ids, *ws, "situ", 2.0, 3.0, cfg)
    y1 = gv.gemv_experts(z, wt, ids, *ws, "situ", 2.0, 3.0, {**cfg, "GLUON": 1})
    assert not torch.isnan(y0).any() and y0.abs().sum() > 0
    assert torch.equal(y0, y1)
