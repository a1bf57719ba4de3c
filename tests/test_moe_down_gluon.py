"""The Gluon grouped down kernel (_moe_down_gluon.py, config GD=1), checked without a GPU (Gluon kernels do not run in
the Triton interpreter): the kernel's program / N-tile / K-step index expressions and the order in which the Gluon
gate-up stores h for it (GDP: `_moe_grouped_gluon._hp_column`, run as written) replayed in float64 on a routing
where one expert holds most tokens, against the float64 reference; the host launch bound by the real JIT and
compiled for sm_90 (Triton 3.7 and, where K31C_TRITON36_SITE names it, 3.6); the dispatch never choosing it off
CUDA. The bf16 kernel itself is checked on the H200 by benches/bench_moe.py's t64 section (float64 reference incl.
a skewed routing, graph replay bitwise equal to eager).
"""

from __future__ import annotations

import os
import textwrap

import pytest
import torch

from codegen.triton import _moe_configs as cfgs, _moe_down_gluon as gdl, _moe_grouped_gluon as ggl
from codegen.triton import moe_grouped_gemm as gg
from ir.formats import quantize_mxfp4
from ir.packed import PackedMXFP4
from tests import test_moe_gemv_gluon as glu_test
from tests.helpers import TR36, skip_without_triton36
from tests import test_moe_grouped_gluon as gg_test
from tests.test_moe_grouped_gluon import _segments
from tests.test_moe_kernels_gpu_paths import _run_ptx

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _operand_columns(nwt: int):
    """(W2's step column of A's logical k, h's stored word-pair position of B's logical k with GDP): logical
    k = 32j + 8t + 2w + p is code pair w, half p of word NWT·t + j, i.e. physical column 8(NWT·t + j) + 4p + w; with
    GDP the B row k is lane t's word 4·NWT·t + 8(j // 2) + (j % 2) + 2w, half p, of h as the gate-up stored it."""
    j, t, w, p = torch.meshgrid(*(torch.arange(n) for n in (nwt, 4, 4, 2)), indexing="ij")
    k = (32 * j + 8 * t + 2 * w + p).flatten()
    col = (8 * (nwt * t + j) + 4 * p + w).flatten()
    pos = (2 * (4 * nwt * t + 8 * (j // 2) + j % 2 + 2 * w) + p).flatten()
    order = torch.argsort(k)
    return col[order], pos[order]


def _replay(h, ids, d2, w, mt, nwt, bn):
    """o [P, l] float64 as the kernel forms it from h [P, I] (expert-sorted rows, natural column order): the
    gate-up's store first permutes h's columns by `_hp_column`; program (e, row block), N tiles of bn rows of h,
    K steps of 32·nwt, two at a time; unwritten rows stay NaN."""
    E, ell, inter = d2.shape
    counts, offsets, pairs = _segments(ids, E)
    m_rows, step = 16 * mt * w, 32 * nwt
    steps = inter // step
    assert steps % 2 == 0
    col_a, pos_b = _operand_columns(nwt)
    stored = torch.full_like(h, float("nan"))
    stored[:, ggl._hp_column.fn(torch.arange(inter), nwt)] = h     # the gate-up writes column r at _hp_column(r)
    o = torch.full((ids.numel(), ell), float("nan"), dtype=torch.float64)
    for pid in range(E * (ell // m_rows)):
        e, r0 = pid // (ell // m_rows), (pid % (ell // m_rows)) * m_rows
        cnt, pos0 = int(counts[e]), int(offsets[e])
        for n0 in range(0, cnt, bn):
            n = torch.arange(bn)
            rows = pos0 + n0 + torch.where(n < cnt - n0, n, 0)
            acc = torch.zeros(m_rows, bn, dtype=torch.float64)
            for st in range(steps):
                acc += d2[e, r0:r0 + m_rows][:, st * step + col_a] @ stored[rows][:, st * step + pos_b].t()
            live = (n0 + n) < cnt
            o[pairs[pos0 + n0 + n[live]], r0:r0 + m_rows] = acc.t()[live]
    return o


@pytest.mark.parametrize("nwt", [2, 4])
def test_index_replay_in_float64_matches_reference_with_skewed_routing(nwt):
    """Expert 1 in every token (two 16-row N tiles, the last partial), one expert without tokens, two row blocks of
    two warps x two 16-row tiles, two K steps: every routed pair's row equals W2_e h in float64, none left unwritten;
    h's stored order (`_hp_column`, run as written) and the operand's word order agree (NWT 2 and 4)."""
    g = torch.Generator().manual_seed(int(torch.randint(0, 2 ** 31, ()).item()))
    E, T, k, w, mt, bn = 4, 19, 2, 2, 2, 16
    ell, inter = 2 * 16 * mt * w, 2 * 32 * nwt
    d2 = PackedMXFP4(*quantize_mxfp4(torch.randn(E, ell, inter, generator=g))).dequantize(torch.float64)
    ids = torch.stack([torch.ones(T, dtype=torch.long), torch.randint(2, E - 1, (T,), generator=g)], 1)
    ids[::5, 1] = 0
    counts, offsets, pairs = _segments(ids, E)
    assert int(counts[1]) > bn and int(counts[E - 1]) == 0
    h = torch.randn(T * k, inter, generator=g).to(torch.bfloat16).double()     # expert-sorted rows
    got = _replay(h, ids, d2, w, mt, nwt, bn)
    e = ids.flatten()[pairs]
    ref = torch.empty_like(got)
    ref[pairs] = torch.einsum("pli,pi->pl", d2[e], h)
    assert not torch.isnan(got).any()
    assert torch.allclose(got, ref, rtol=1e-12, atol=1e-12 * ref.abs().max().item())


# the gate-up test's sm_90 driver stand-in and compile record (each compiled PTX kept too), then the down kernel's
# launches and the gate-up's with h in the down kernel's order and GGU
_FAKE_LAUNCH = gg_test._FAKE_LAUNCH.split("from codegen.triton import _moe_grouped_gluon as G")[0] + textwrap.dedent("""
    ptxs = []
    _compile = triton.compile

    def _keep_ptx(*args, **kwargs):
        k = _compile(*args, **kwargs)
        ptxs.append(k.asm["ptx"])
        return k

    triton.compile = _keep_ptx
    from codegen.triton import _moe_down_gluon as D, _moe_grouped_gluon as G
    from ir.formats import quantize_mxfp4
    from ir.packed import PackedMXFP4
    E, L, I, T, K = 3, 256, 256, 4, 2
    g = torch.Generator().manual_seed(0)
    w1, w2, w3 = (PackedMXFP4(*quantize_mxfp4(torch.randn(E, n, m, generator=g))) for n, m in ((I, L), (L, I), (I, L)))
    ids = torch.tensor([[0, 2], [1, 2], [2, 0], [1, 0]])
    flat = ids.flatten()
    counts = torch.bincount(flat, minlength=E).int()
    seg = types.SimpleNamespace(counts=counts, offsets=(torch.cumsum(counts, 0) - counts).int(), topk=K,
                                pair_ids=torch.argsort(flat, stable=True).int())
    h = torch.randn(T * K, I).to(torch.bfloat16)
    o = torch.empty(T * K, L, dtype=torch.bfloat16)
    D.down(h, seg, w2, o, {"GDW": 2, "GDM": 1, "GDN": 4, "GDB": 16}, 4)
    D.down(h, seg, w2, o, {"GDW": 2, "GDM": 2, "GDN": 4, "GDB": 16}, 4)
    G.gate_up(torch.randn(T, L).to(torch.bfloat16), seg, w1, w3, h, dict(ACT=0, HAS_BETA2=True), (4.0, 25.0),
              {"GGW": 2, "GGM": 1, "GGN": 4, "GGB": 16, "GGD": 1, "GGU": 1}, hp=4)
    for s, ptx in zip(seen, ptxs):
        s["prmt"], s["early"] = ptx.count("prmt.b32"), ptx.find("ld.global.v4.b32") < ptx.find("griddepcontrol.wait")
    print(json.dumps(seen))
""")


@pytest.mark.parametrize("tr36", [False, True])
def test_host_launch_binds_and_compiles_for_sm90_without_shared_memory(tr36):
    """down's launch (arguments, constexpr layouts, warps, PDL) bound by the real JIT against a driver that reports
    sm_90 and compiled, never launched: two K steps an iteration of MT x (BN/8) x (32·NWT/16) mma.sync each,
    16-byte loads of the words (2·MT a step) and of h (2·NWT a step at BN 16) in each step plus the first two steps'
    words and the first step's h, all after the PDL wait (MT 1 and 2). No shared memory anywhere; one PDL wait; the
    gate-up with h in that order and GGU (two steps an iteration, z's column pairs by 4 PRMT a 16-byte load)."""
    skip_without_triton36(tr36)
    seen = glu_test._aot(f"{TR36}:{ROOT}" if tr36 else None, _FAKE_LAUNCH)
    assert [s["name"] for s in seen] == ["_grouped_down_kernel"] * 2 + ["_grouped_gate_up_kernel"], seen
    assert all(s["triton"].startswith("3.6" if tr36 else "3.7") for s in seen), seen
    for s, mt in ((seen[0], 1), (seen[1], 2)):
        assert s["mma"] == 2 * mt * 2 * 8 and s["v4"] == 2 * (2 * mt + 2 * 4) + 2 * 2 * mt + 2 * 4, (mt, s)
    c = seen[2]
    assert c["mma"] == 2 * 2 * 1 * 2 * 8 and c["prmt"] == 2 * 4 * 2 * 4, c
    assert not any(s["early"] for s in seen), seen
    assert all(s["shared"] == 0 and s["wait"] == 1 and s["num_warps"] == 2 and s["launch_pdl"] for s in seen), seen


def test_never_chosen_off_cuda_and_tiles_fit_the_model():
    """GD=1 is rejected by the constraints without a CUDA sm_90 target and `h_order` gives 0 on CPU tensors (the
    dispatch then launches the Triton down kernel, and the gate-up writes h in column order); GLUON_T64's tiling
    covers the model's l=3584, I=3072 without masks; the heuristic takes it (with GGU) at T=64 on the H200 only."""
    key = {"MX": True, "BF16": True}
    base = {**cfgs.BATCH_INVARIANT_CONFIG, "DEQ": "bytes", "PATH": "grouped"}
    assert any("GD" in m for m in cfgs.constraints({**base, "GD": 1}, key, None))
    assert not any("GD" in m for m in cfgs.constraints({**base, "GD": 1}, key, {"compute_capability": (9, 0)}))
    assert gdl.fits(3584, 3072, gdl.tiles(cfgs.GLUON_T64)) and gdl.tiles(cfgs.GLUON_T64) == (4, 2, 4, 16)
    assert not gdl.fits(3584, 3072 - 128, (4, 2, 4, 16)) and not gdl.fits(3584 - 16, 3072, (4, 2, 4, 16))
    assert not gdl.fits(3584, 3072, (4, 2, 1, 16))      # NWT 1: no operand order for h
    g = torch.Generator().manual_seed(int(torch.randint(0, 2 ** 31, ()).item()))
    w2 = PackedMXFP4(*quantize_mxfp4(torch.randn(2, 128, 256, generator=g)))
    h = torch.randn(3, 256, generator=g).to(torch.bfloat16)
    cfg = {"GD": 1, "GDW": 2, "GDM": 2}
    assert gdl.fits(128, 256, gdl.tiles(cfg)) and gdl.h_order(h, w2, cfg, 1) == 0
    tk = gg._key(64, 112, 16, 3584, 3072, True, torch.bfloat16, {})
    h200 = gg.heuristic(tk, "h200")
    assert h200["GD"] == 1 and h200["GGU"] == 1 and not cfgs.constraints(h200, key, {"compute_capability": (9, 0)})
    for other in ("cpu", "b200"):
        assert gg.heuristic(tk, other).get("GD") is None


def test_gate_up_word_pairs_are_the_code_pair_order():
    """GGU's PRMT text: the four int32 words of 8 bf16 columns (each passed twice) -> registers c = (column c,
    column c + 4), the order `_x_operand` re-packs to, for random words."""
    import numpy as np
    rng = np.random.default_rng(int(torch.randint(0, 2 ** 31, ()).item()))
    words = [rng.integers(0, 2 ** 32, 4096, dtype=np.uint64).astype(np.uint32) for _ in range(4)]
    got = _run_ptx(str(ggl.Z_PAIRS_ASM.value), {f"${4 + i}": words[i // 2] for i in range(8)})
    cols = [(words[q] >> (16 * p)) & 0xFFFF for q in range(4) for p in range(2)]      # column 2q + p
    for c in range(4):
        assert np.array_equal(got[f"${c}"], cols[c] | (cols[c + 4] << 16)), c


_DONE_LAUNCH = _FAKE_LAUNCH.split("D.down(h, seg")[0] + textwrap.dedent("""
    done = torch.zeros(2 * E, dtype=torch.int32)
    cfg = {"GGW": 2, "GGM": 1, "GGN": 4, "GGB": 16, "GGD": 1, "GGU": 1, "GDW": 2, "GDM": 2, "GDN": 4, "GDB": 16}
    G.gate_up(torch.randn(T, L).to(torch.bfloat16), seg, w1, w3, h, dict(ACT=0, HAS_BETA2=True), (4.0, 25.0), cfg,
              hp=4, done=done)
    D.down(h, seg, w2, o, cfg, 4, done, G.row_blocks(w1, cfg))
    for s, ptx in zip(seen, ptxs):
        s.update(release=ptx.count("atom.global.gpu.release.add"), acq_rel=ptx.count("atom.global.gpu.acq_rel.add"),
                 exch=ptx.count("atom.global.gpu.relaxed.exch"), acquire=ptx.count("ld.global.gpu.acquire"),
                 waits=ptx.count("griddepcontrol.wait"))
    print(json.dumps(seen))
""")


def test_done_counters_compile_to_the_overlap_protocol():
    """Config GDO (the down kernel started on each expert as its gate-up programs finish) as compiled for sm_90: the
    gate-up counts in with one release add after its stores (one PDL wait, first); the down kernel reads its expert's
    count by acquire loads (before its spin loop and in it), counts in with one acq_rel add, the last arriver resets
    both counters (two exchanges), and it has two PDL wait sites (before the first store; at the end without tokens).
    The ordering itself is what the H200 checks (bench_moe.py, MOE_BENCH_T64_GDO=1: the whole op against the fp32
    reference, skewed routing, wide scales, graph replay == eager over replays)."""
    seen = glu_test._aot(None, _DONE_LAUNCH)
    assert [s["name"] for s in seen] == ["_grouped_gate_up_kernel", "_grouped_down_kernel"], seen
    up, dn = seen
    assert up["release"] == 1 and up["acq_rel"] == up["exch"] == up["acquire"] == 0 and up["waits"] == 1, up
    assert dn["release"] == 0 and dn["acq_rel"] == 1 and dn["exch"] == 2 and dn["acquire"] == 2, dn
    assert dn["waits"] == 2 and dn["launch_pdl"] and up["launch_pdl"], dn
