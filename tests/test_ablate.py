"""The ablation benches' kernel rebuilding (benches/_ablate.py), checked without a GPU: an edit that no longer finds its
text exactly once stops the bench and names itself; every edit of the MLA and MoE ablations applies to today's kernel
sources; and the MoE kernels rebuilt with each part taken out compile for sm_90 (a subprocess with a driver that
reports sm_90, nothing launched) and lose exactly that part: bit 2 the activation loads of the loop, bit 8 the decode's
integer multiplies, bit 4 none of the weight loads (they come from a two-step window instead), bit 0 nothing."""

from __future__ import annotations

import os
import sys
import textwrap

import pytest

from benches._ablate import ablated_module, guard
from tests import test_moe_gemv_gluon as glu_test

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_guard_and_missing_or_repeated_text_stop_the_bench():
    from codegen.triton import _pdl
    assert guard("        x = 1\n        y = 2", 4, "x = 0") == ("        if ABL & 4 == 0:\n            x = 1\n"
                                                              "            y = 2\n        else:\n            x = 0")
    with pytest.raises(SystemExit, match="'missing' finds its text 0 times"):
        ablated_module(_pdl, {"missing": ("no such text in the module", "")}, "test")
    with pytest.raises(SystemExit, match="'twice' finds its text [2-9]"):
        ablated_module(_pdl, {"twice": ("PDL", "PDL")}, "test")
    mod = ablated_module(_pdl, {"rename": ("def enabled() -> bool:", "def enabled_ablated() -> bool:")}, "test")
    assert hasattr(mod, "enabled_ablated") and not hasattr(mod, "enabled") and mod.__name__ == "_pdl_ablated"


def test_mla_ablation_edits_apply_to_the_kernel():
    sys.path.insert(0, os.path.join(ROOT, "benches"))
    from benches import mla_ablation
    from codegen.triton import _mla_gluon
    mod = ablated_module(_mla_gluon, mla_ablation.EDITS, "test_mla_ablation")
    assert "ABL" in mod._mla_gluon_kernel.arg_names


_MOE_BUILD = glu_test._FAKE_LAUNCH.split("seen = []")[0] + textwrap.dedent("""
    import types
    sys.path.insert(0, os.path.join(sys.argv[1], "benches"))
    seen = []

    def _do_compile(self, key, signature, device, constexprs, options, attrs, warmup):
        k = triton.compile(self.ASTSource(self, signature, constexprs, attrs), target=GPUTarget("cuda", 90, 32),
                           options=options.__dict__)
        ptx = k.asm["ptx"]
        seen.append([self.__name__, ptx.count("mma.sync"), ptx.count("ld.global.v4"), ptx.count("mul.lo.u32")])

    JITFunction._do_compile = _do_compile
    from _ablate import AblatedLaunch, ablated_module
    import _moe_ablation as A
    from codegen.triton import _moe_down_gluon as D, _moe_grouped_gluon as G
    from ir.formats import quantize_mxfp4
    from ir.packed import PackedMXFP4
    up = AblatedLaunch(ablated_module(G, A.GATE_UP_EDITS, "test")._grouped_gate_up_kernel)
    dn = AblatedLaunch(ablated_module(D, A.DOWN_EDITS, "test")._grouped_down_kernel)
    G._grouped_gate_up_kernel, D._grouped_down_kernel = up, dn
    E, L, I, T, K = 3, 512, 128, 4, 2
    g = torch.Generator().manual_seed(0)
    w1, w3 = (PackedMXFP4(*quantize_mxfp4(torch.randn(E, I, L, generator=g))) for _ in range(2))
    w2 = PackedMXFP4(*quantize_mxfp4(torch.randn(E, L, I, generator=g)))
    flat = torch.tensor([[0, 2], [1, 2], [2, 0], [1, 0]]).flatten()
    counts = torch.bincount(flat, minlength=E).int()
    seg = types.SimpleNamespace(counts=counts, offsets=(torch.cumsum(counts, 0) - counts).int(), topk=K,
                                pair_ids=torch.argsort(flat, stable=True).int())
    z = torch.randn(T, L).to(torch.bfloat16)
    h, o = torch.empty(T * K, I, dtype=torch.bfloat16), torch.empty(T * K, L, dtype=torch.bfloat16)
    cfg = {"GG": 1, "GGW": 4, "GGM": 1, "GGN": 4, "GGB": 16, "GGD": 1, "GGR": 128, "GGU": 1, "GD": 1, "GDW": 4,
           "GDM": 2, "GDN": 4, "GDB": 16}
    out = {}
    for b in (0, 2, 4, 8):
        up.abl = dn.abl = b
        seen.clear()
        G.gate_up(z, seg, w1, w3, h, dict(ACT=0, HAS_BETA2=True), (4.0, 25.0), cfg, 4)
        D.down(h, seg, w2, o, cfg, 4)
        out[b] = list(seen)
    print(json.dumps(out))
""")


def test_moe_ablations_compile_and_remove_their_part():
    res = glu_test._aot(None, _MOE_BUILD)
    base = {name: (mma, v4, mul) for name, mma, v4, mul in res["0"]}
    assert set(base) == {"_grouped_gate_up_kernel", "_grouped_down_kernel"}, res
    for name, (mma, v4, mul) in base.items():
        assert mma > 0 and v4 > 0 and mul > 0, res
    for bit, rows in res.items():
        for name, mma, v4, mul in rows:
            b_mma, b_v4, b_mul = base[name]
            assert mma == b_mma, (bit, name, res)                      # every ablation keeps the MMAs
            if bit == "2":
                assert v4 < b_v4 and mul == b_mul, (bit, name, res)    # activation loads gone, decode kept
            elif bit == "4":
                assert v4 == b_v4 and mul == b_mul, (bit, name, res)   # the same loads (a window), decode kept
            elif bit == "8":
                assert mul == 0 and v4 == b_v4, (bit, name, res)       # decode gone, loads kept
