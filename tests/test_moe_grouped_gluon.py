"""The Gluon grouped gate-up (_moe_grouped_gluon.py, config GG=1), checked without a GPU (Gluon kernels do not run in
the Triton interpreter): the kernel's program / N-tile / K-step index expressions replayed in float64 on a routing
where one expert holds most tokens (several N tiles, a partial last one) against the float64 reference; the host
launch bound by the real JIT and compiled for sm_90 (mma.sync fed from registers, no shared memory, one PDL wait;
Triton 3.7 and, where K31C_TRITON36_SITE names it, 3.6); the dispatch never choosing it off CUDA. The bf16 kernel
itself is checked on the H200 by benches/bench_moe.py's t64 section (float64 reference incl. a skewed routing,
graph replay bitwise equal to eager).
"""

from __future__ import annotations

import os
import textwrap

import numpy as np
import pytest
import torch

from codegen.triton import _moe_configs as cfgs, _moe_gemv_gluon as glu, _moe_grouped_gluon as ggl
from codegen.triton import moe_grouped_gemm as gg
from ir.formats import quantize_mxfp4
from ir.packed import PackedMXFP4
from ir.ref.moe import situ_glu
from tests import test_moe_gemv_gluon as glu_test
from tests.helpers import TR36, skip_without_triton36
from tests.test_moe_kernels_gpu_paths import _run_ptx

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
B1, B2 = 4.0, 25.0


@pytest.mark.parametrize("wide", [False, True])
def test_multiply_decode_equals_word_asm_on_every_half_word(wide):
    """DEC 1's text (masks and integer multiplies) gives WORD_ASM's bits for every 16-bit pattern in each half under
    scale bytes 2^-127 .. 2^127 (WIDE: up to 254), and those are the float64 dequantisation (value i: code PI[i])."""
    lo = np.arange(1 << 16, dtype=np.uint32)
    hi = np.random.default_rng(int(torch.randint(0, 2 ** 31, ()).item())).permutation(lo).astype(np.uint32)
    words = lo | (hi << 16)
    for s in [1, 77, 128] + ([129, 254] if wide else [0]):
        f = s << 7 if wide else (s + 126) << 7
        ops = {"$4": words, "$12": np.uint32(f | (f << 16))}
        got = _run_ptx(str((ggl.WORD_MUL_ASM_WIDE if wide else ggl.WORD_MUL_ASM).value), ops)
        want = _run_ptx(str((glu.WORD_ASM_WIDE if wide else glu.WORD_ASM).value), ops)
        for r in range(4):
            assert np.array_equal(got[f"${r}"], want[f"${r}"]), (s, r)
        packed = torch.from_numpy(words.view(np.uint8).copy()).view(-1, 16)
        ref = PackedMXFP4(packed, torch.full((packed.shape[0], 1), s, dtype=torch.uint8)).dequantize(torch.float64)
        ref = ref.reshape(-1, 8)[:, [0, 4, 1, 5, 2, 6, 3, 7]]
        val = torch.stack([torch.from_numpy(((got[f"${i // 2}"] >> (16 * (i % 2))) & 0xFFFF).astype(np.int32)
                                            .astype(np.int16)).view(torch.bfloat16).double() for i in range(8)], 1)
        assert not torch.isnan(val).any() and torch.equal(val, ref), s


def _segments(ids: torch.Tensor, E: int):
    """counts, exclusive offsets, pair ids grouped by expert (ascending within one), as permute_tokens returns."""
    flat = ids.flatten()
    counts = torch.bincount(flat, minlength=E)
    offsets = torch.cumsum(counts, 0) - counts
    return counts, offsets, torch.argsort(flat, stable=True)


def _replay(z, ids, d1, d3, w, mt, nwt, bn):
    """h [P, I] float64 as the kernel forms it: program (e, row block), N tiles of bn token columns, K steps of
    32·nwt (A value i of word NWT·t + j at logical k 32j + 8t + i is code PI[i] = c + 4a (i = 2c + a); B row
    32j + 8t + 2c + a holds column 8(NWT·t + j) + 4a + c); unwritten rows stay NaN."""
    E, inter, ell = d1.shape
    k = ids.shape[1]
    counts, offsets, pairs = _segments(ids, E)
    m_rows, steps = 16 * mt * w, ell // (32 * nwt)
    h = torch.full((ids.numel(), inter), float("nan"), dtype=torch.float64)
    jj, tt, cc, aa = torch.meshgrid(*(torch.arange(n) for n in (nwt, 4, 4, 2)), indexing="ij")
    col_b = (8 * (nwt * tt + jj) + 4 * aa + cc).flatten()        # B's logical row order -> physical column
    i = 2 * cc + aa
    col_a = (8 * (nwt * tt + jj) + (i % 2) * 4 + i // 2).flatten()  # code PI[i] of word NWT·t + j
    assert torch.equal(col_a, col_b)
    for pid in range(E * (inter // m_rows)):
        e, r0 = pid // (inter // m_rows), (pid % (inter // m_rows)) * m_rows
        cnt, pos0 = int(counts[e]), int(offsets[e])
        for n0 in range(0, cnt, bn):
            n = torch.arange(bn)
            tok = pairs[pos0 + n0 + torch.where(n < cnt - n0, n, 0)] // k
            acc1 = torch.zeros(m_rows, bn, dtype=torch.float64)
            acc3 = torch.zeros_like(acc1)
            for st in range(steps):
                kk = st * 32 * nwt + col_b
                b = z[tok][:, kk].double().t()
                acc1 += d1[e, r0:r0 + m_rows][:, st * 32 * nwt + col_a] @ b
                acc3 += d3[e, r0:r0 + m_rows][:, st * 32 * nwt + col_a] @ b
            live = (n0 + n) < cnt
            h[pos0 + n0 + n[live], r0:r0 + m_rows] = situ_glu(acc1, acc3, B1, B2).t()[live]
    return h


def test_index_replay_in_float64_matches_reference_with_skewed_routing(w=2, mt=2, nwt=2, bn=8):
    """Expert 1 in every token (three N tiles, the last partial), one expert without tokens, two row blocks of two
    warps x two 16-row tiles, two K steps: every routed row equals the float64 reference, none left unwritten."""
    g = torch.Generator().manual_seed(int(torch.randint(0, 2 ** 31, ()).item()))
    E, T, k = 4, 19, 2
    ell, inter = 2 * 32 * nwt, 2 * 16 * mt * w
    d1, d3 = (PackedMXFP4(*quantize_mxfp4(torch.randn(E, inter, ell, generator=g))).dequantize(torch.float64)
              for _ in range(2))
    z = torch.randn(T, ell, generator=g).to(torch.bfloat16)
    ids = torch.stack([torch.ones(T, dtype=torch.long), torch.randint(2, E - 1, (T,), generator=g)], 1)
    ids[::5, 1] = 0
    got = _replay(z, ids, d1, d3, w, mt, nwt, bn)
    counts, offsets, pairs = _segments(ids, E)
    assert int(counts[1]) > 16 and int(counts[E - 1]) == 0
    zt = z.double()[pairs // k]
    e = ids.flatten()[pairs]
    ref = situ_glu(torch.einsum("pnl,pl->pn", d1[e], zt), torch.einsum("pnl,pl->pn", d3[e], zt), B1, B2)
    assert not torch.isnan(got).any()
    assert torch.allclose(got, ref, rtol=1e-12, atol=1e-12 * ref.abs().max().item())


# the sm_90 driver stand-in of the per-pair path's launch test, then this kernel's own compile record and launch
_FAKE_LAUNCH = glu_test._FAKE_LAUNCH.split("seen = []")[0] + textwrap.dedent("""
    import types
    seen = []

    def _do_compile(self, key, signature, device, constexprs, options, attrs, warmup):
        k = triton.compile(self.ASTSource(self, signature, constexprs, attrs), target=GPUTarget("cuda", 90, 32),
                           options=options.__dict__)
        ptx = k.asm["ptx"]
        seen.append({"name": self.__name__, "mma": ptx.count("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32"),
                     "v4": ptx.count("ld.global.v4.b32"), "shared": ptx.count(".shared"),
                     "num_warps": options.num_warps, "launch_pdl": bool(options.__dict__.get("launch_pdl")),
                     "wait": ptx.count("griddepcontrol.wait"), "triton": triton.__version__})

    JITFunction._do_compile = _do_compile
    from codegen.triton import _moe_grouped_gluon as G
    from ir.formats import quantize_mxfp4
    from ir.packed import PackedMXFP4
    E, L, I, T, K = 3, 256, 64, 4, 2
    g = torch.Generator().manual_seed(0)
    w1, w3 = (PackedMXFP4(*quantize_mxfp4(torch.randn(E, I, L, generator=g))) for _ in range(2))
    ids = torch.tensor([[0, 2], [1, 2], [2, 0], [1, 0]])
    flat = ids.flatten()
    counts = torch.bincount(flat, minlength=E).int()
    seg = types.SimpleNamespace(counts=counts, offsets=(torch.cumsum(counts, 0) - counts).int(), topk=K,
                                pair_ids=torch.argsort(flat, stable=True).int())
    z = torch.randn(T, L).to(torch.bfloat16)
    h = torch.empty(T * K, I, dtype=torch.bfloat16)
    G.gate_up(z, seg, w1, w3, h, dict(ACT=0, HAS_BETA2=True), (4.0, 25.0),
              {"GGW": 2, "GGM": 2, "GGN": 4, "GGB": 16, "GGD": 1})
    print(json.dumps(seen))
""")


@pytest.mark.parametrize("tr36", [False, True])
def test_host_launch_binds_and_compiles_for_sm90_without_shared_memory(tr36):
    """gate_up's launch (arguments, constexpr layouts, warps, PDL) bound by the real JIT against a driver that
    reports sm_90 and compiled, never launched: a K step's 2 x MT x (BN/8) x (32·NWT/16) mma.sync in one loop body,
    16-byte loads of the words (MT x 2 rows a matrix) and the activation (NWT x BN/8) a step plus the first step's,
    no shared memory at all (the decoded tile and the activations stay in registers), one PDL wait."""
    skip_without_triton36(tr36)
    seen = glu_test._aot(f"{TR36}:{ROOT}" if tr36 else None, _FAKE_LAUNCH)
    assert len(seen) == 1 and seen[0]["name"] == "_grouped_gate_up_kernel", seen
    s = seen[0]
    assert s["triton"].startswith("3.6" if tr36 else "3.7"), s
    assert s["mma"] == 2 * 2 * 2 * 8 and s["v4"] == 2 * (2 * 2 * 2 + 4 * 2), s
    assert s["shared"] == 0 and s["wait"] == 1 and s["num_warps"] == 2 and s["launch_pdl"], s


def test_never_chosen_off_cuda_and_tiles_fit_the_model():
    """GG=1 is rejected by the constraints without a CUDA sm_90 target and not usable on CPU tensors (the dispatch
    then launches the Triton gate-up); GLUON_T64 covers the model's l=3584, I=3072 without masks; the heuristic takes
    it at T=64 on the H200 only."""
    key = {"MX": True, "BF16": True}
    base = {**cfgs.BATCH_INVARIANT_CONFIG, "DEQ": "bytes", "PATH": "grouped"}
    assert any("GG" in m for m in cfgs.constraints({**base, "GG": 1}, key, None))
    assert not any("GG" in m for m in cfgs.constraints({**base, "GG": 1}, key, {"compute_capability": (9, 0)}))
    assert ggl.fits(3584, 3072, ggl.tiles(cfgs.GLUON_T64)) and not ggl.fits(3584, 3000, ggl.tiles(cfgs.GLUON_T64))
    assert not any("GG" in m for m in cfgs.constraints({**base, **cfgs.GLUON_T64}, key, {"compute_capability": (9, 0)}))
    g = torch.Generator().manual_seed(int(torch.randint(0, 2 ** 31, ()).item()))
    w1, w3 = (PackedMXFP4(*quantize_mxfp4(torch.randn(2, 64, 128, generator=g))) for _ in range(2))
    z = torch.randn(3, 128, generator=g).to(torch.bfloat16)
    assert ggl.fits(128, 64, ggl.tiles({"GGW": 1, "GGM": 1}))
    assert not ggl.usable(z, w1, w3, {"GG": 1, "GGW": 1, "GGM": 1}, 1)
    h200 = gg.heuristic(gg._key(64, 112, 16, 3584, 3072, True, torch.bfloat16, {}), "h200")   # T=64 top-16 on sm_90
    assert all(h200[k] == v for k, v in {**cfgs.DECODE_T64, **cfgs.GLUON_T64}.items())   # under 128-byte L2 fetches
    assert not cfgs.constraints(h200, {"MX": True, "BF16": True}, {"compute_capability": (9, 0)})
    for other in ("cpu", "b200"):   # not on CPU (interpreter) nor where it was not measured
        assert gg.heuristic(gg._key(64, 112, 16, 3584, 3072, True, torch.bfloat16, {}), other).get("GG") is None
