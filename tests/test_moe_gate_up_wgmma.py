"""The Gluon gate-up on wgmma (_moe_gate_up_wgmma.py, config GGX=1), checked without a GPU (Gluon kernels do not run in
the Triton interpreter): the activation column order the host writes (`logical_columns`) against the labels the
kernel gives its decoded registers (`_a_mul(..., WG=1)`, derived here from the decode's documented placement) and the
float64 product it implies; the host launch bound by the real JIT and compiled for sm_90 (Triton 3.7 and, where
K31C_TRITON36_SITE names it, 3.6): asynchronous wgmmas with A in registers, the words by TMA, no spill at a 128-register
cap, one PDL wait; never chosen off CUDA. Its bf16 results are checked on the H200 by bench_moe.py's t64 section
(MOE_BENCH_T64_WG=1: float64 reference incl. a skewed routing and wide scales, graph replay bitwise equal to eager).
"""

from __future__ import annotations

import os
import textwrap

import pytest
import torch

from codegen.triton import _moe_gate_up_wgmma as wg
from ir.formats import quantize_mxfp4
from ir.packed import PackedMXFP4
from tests import test_moe_gemv_gluon as glu_test
from tests.helpers import TR36, skip_without_triton36

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.parametrize("nwt", [2, 4])
def test_activation_order_matches_the_registers_labels(nwt):
    """A thread's decoded registers (word NWT·t + j of its row, register c = code pair (c, c + 4), half a: code
    c + 4a, i.e. physical column 8(NWT·t + j) + c + 4a of the step) relabelled as `_a_mul(WG=1)` does (reshape to
    (j, t, c1, c0, a), permute to (j, c1, c0, t, a)) give, column by column, exactly the physical columns
    `logical_columns` puts there; it is a permutation within each step of 32·NWT columns."""
    j, t, c, a = torch.meshgrid(torch.arange(nwt), torch.arange(4), torch.arange(4), torch.arange(2), indexing="ij")
    phys = 8 * (nwt * t + j) + c + 4 * a                       # [NWT, 4, 4, 2]: (j, t, c, a) as the decode places them
    regs = phys.reshape(nwt, 4, 8)                               # i = 2c + a, the asm's output order
    labelled = regs.reshape(nwt, 4, 2, 2, 2).permute(0, 2, 3, 1, 4).reshape(32 * nwt)
    ell = 3 * 32 * nwt
    cols = torch.tensor(wg.logical_columns(ell, nwt))
    for st in range(3):
        step = cols[st * 32 * nwt:(st + 1) * 32 * nwt] - st * 32 * nwt
        assert torch.equal(step, labelled), (nwt, st)
        assert torch.equal(step.sort().values, torch.arange(32 * nwt))


def test_permuted_operands_give_the_float64_product():
    """W z^T over the logical columns (W's columns and z's both taken in `logical_columns` order, z by
    `permute_columns`) equals the float64 product over the physical ones on random MXFP4 weights."""
    g = torch.Generator().manual_seed(int(torch.randint(0, 2 ** 31, ()).item()))
    ell = 2 * 128
    w = PackedMXFP4(*quantize_mxfp4(torch.randn(64, ell, generator=g))).dequantize(torch.float64)
    z = torch.randn(5, ell, generator=g).to(torch.bfloat16)
    zp = wg.permute_columns(z)
    cols = torch.tensor(wg.logical_columns(ell))
    got = w[:, cols] @ zp.double().t()
    ref = w @ z.double().t()
    assert torch.equal(zp, z[:, cols]) and not torch.isnan(got).any()
    assert torch.allclose(got, ref, rtol=1e-12, atol=1e-12 * ref.abs().max().item())


_FAKE_LAUNCH = glu_test._FAKE_LAUNCH.split("seen = []")[0] + textwrap.dedent("""
    import subprocess, tempfile, types
    seen = []
    BIN = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")

    def _do_compile(self, key, signature, device, constexprs, options, attrs, warmup):
        k = triton.compile(self.ASTSource(self, signature, constexprs, attrs), target=GPUTarget("cuda", 90, 32),
                           options=options.__dict__)
        with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
            f.write(k.asm["cubin"])
            f.flush()
            sass = subprocess.run([os.path.join(BIN, "cuobjdump"), "-sass", f.name], capture_output=True,
                                  text=True).stdout
        ptx = k.asm["ptx"]
        seen.append({"name": self.__name__, "wgmma": ptx.count("wgmma.mma_async"),
                     "wgmma_wait": ptx.count("wgmma.wait_group"), "sass_wait": sass.count("WARPGROUP.DEPBAR"),
                     "tma": ptx.count("cp.async.bulk.tensor"), "cp_async": ptx.count("cp.async.cg.shared.global"),
                     "local": sass.count("STL") + sass.count("LDL"), "shared": k.metadata.shared,
                     "num_warps": options.num_warps, "wait": ptx.count("griddepcontrol.wait"),
                     "launch_pdl": bool(options.__dict__.get("launch_pdl")), "triton": triton.__version__})

    JITFunction._do_compile = _do_compile
    from codegen.triton import _moe_gate_up_wgmma as G
    from ir.formats import quantize_mxfp4
    from ir.packed import PackedMXFP4
    E, L, I, T, K = 3, 512, 128, 4, 2
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
              {"GG": 1, "GGW": 4, "GGM": 1, "GGN": 4, "GGB": 16, "GGD": 1, "GGR": 128, "GGX": 1, "GGS": 4}, 4)
    print(json.dumps(seen))
""")


@pytest.mark.parametrize("tr36", [False, True])
def test_host_launch_binds_and_compiles_async_wgmma_for_sm90(tr36):
    """gate_up's launch bound by the real JIT against a driver that reports sm_90 and compiled, never launched: a K
    step's 2 x 8 wgmmas (m64 n16 k16, A in registers) in one loop body with one wait, not serialised by ptxas (one
    WARPGROUP.DEPBAR a step), each step's words of w1 and w3 by TMA and its B columns by 16-byte cp.async (the
    prologue's S - 1 steps, the loop's one), no local memory under the 128-register cap, one PDL wait, 4 rings of 4 slots within a quarter of
    the SM's shared memory (four programs an SM)."""
    skip_without_triton36(tr36)
    seen = glu_test._aot(f"{TR36}:{ROOT}" if tr36 else None, _FAKE_LAUNCH)
    assert len(seen) == 1 and seen[0]["name"] == "_wg_gate_up_kernel", seen
    s = seen[0]
    assert s["triton"].startswith("3.6" if tr36 else "3.7"), s
    assert s["wgmma"] == 2 * 8 and s["wgmma_wait"] == 1 and s["sass_wait"] == 1, s
    S = 4       # the prologue's S - 1 steps and the loop's one, two matrices; 16 rows x 256 bytes = 2 copies a thread
    assert s["tma"] == 2 * S and s["cp_async"] == 2 * S and s["local"] == 0, s
    assert s["wait"] == 1 and s["num_warps"] == 4 and s["launch_pdl"] and s["shared"] <= 227 * 1024 // 4, s


def test_never_usable_off_cuda_or_on_other_tilings():
    """On CPU tensors (and in the interpreter) the register form runs; GGX needs the W4 x MT1 x NWT4 x BN16 tiling."""
    g = torch.Generator().manual_seed(int(torch.randint(0, 2 ** 31, ()).item()))
    w1, w3 = (PackedMXFP4(*quantize_mxfp4(torch.randn(2, 64, 256, generator=g))) for _ in range(2))
    z = torch.randn(3, 256, generator=g).to(torch.bfloat16)
    assert not wg.usable(z, w1, w3, {"GG": 1, "GGX": 1}, 1)
    assert not wg.enabled({"GG": 1}) and wg.enabled({"GGX": 1})
