"""The persistent Gluon KDA decode (`codegen/triton/_kda_decode_gluon.py`, config GLUON) checked without a GPU (Gluon
does not run in the interpreter): the launcher's launches recorded for sm_90 by the AOT recorder and compiled with
Triton 3.7 and 3.6 (no spills, the state moved by TMA as column halves: the NBUF - 1 prologue loads, the refills
and the two halves' stores behind mbarriers; one PDL wait; the ring in shared memory), kept states routed to the
Triton kernel, the two-pass recurrence the kernel computes (column half by column half) equal to the reference
recurrence in float64, and the dispatch rules. Its
bf16 results are checked on the H200 by benches/bench_kda.py (vs the unfused ops, ragged steps with empty and
3-token requests, the PDL race check, graph replay == eager).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch

from codegen.triton import _kda_decode_gluon as glu
from codegen.triton.kda_decode import heuristic
from ir.ref import kda as ref
from tests.helpers import TR36, skip_without_triton36

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

_SM90_BUILD = textwrap.dedent("""
    import os, sys, json, subprocess, tempfile
    os.environ["TRITON_INTERPRET"] = "0"
    sys.path.insert(0, sys.argv[1])
    import torch, triton
    from triton.backends.compiler import GPUTarget
    from codegen.aot.record import Recorder
    from codegen.triton.kda_decode import kda_decode
    from tests.kda_decode_case import decode_operands
    target = GPUTarget("cuda", 90, 32)
    H, D = 2, 128      # CPU tensors stand in for CUDA ones (nothing is launched)
    ops = decode_operands(torch.Generator().manual_seed(0), H, D, [1, 2], D, 3)  # rank D, as in the model
    ops = [x.to(torch.bfloat16) if i in (0, 1, 2, 3, 4, 5, 7, 8, 11, 13) else x for i, x in enumerate(ops)]
    # 27 requests of 5 heads: 135 pairs on the recorder's 132 SMs, so GLUON 2's programs change heads (f_b per pair)
    wide = decode_operands(torch.Generator().manual_seed(1), 5, D, [1] * 27, D, 27)
    wide = [x.to(torch.bfloat16) if i in (0, 1, 2, 3, 4, 5, 7, 8, 11, 13) else x for i, x in enumerate(wide)]
    with Recorder(target) as rec:     # the softplus gate (the H200 bench runs the lower-bound one)
        kda_decode(*ops, scale=D ** -0.5, lower_bound=None, norm_eps=1e-5, gluon=2)  # the gate in the kernel
        kda_decode(*ops, scale=D ** -0.5, lower_bound=None, norm_eps=1e-5, gluon=1)  # f by the GEMM before it
        kda_decode(*ops, scale=D ** -0.5, lower_bound=-5.0, norm_eps=1e-5, gluon=True, keep_states=True)
        kda_decode(*wide, scale=D ** -0.5, lower_bound=None, norm_eps=1e-5, gluon=2)
    seen = []
    cuobjdump = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    for spec in rec.specs.values():
        fn, sig, cx, attrs, opts = spec.compile_args
        if fn.fn.__name__ == "_kda_decode_gluon_kernel":
            k = triton.compile(fn.ASTSource(fn, sig, cx, attrs), target=target, options=dict(vars(opts)))
            cubin = os.path.join(tempfile.mkdtemp(), "k.cubin")
            open(cubin, "wb").write(k.asm["cubin"])
            sass, ptx = subprocess.check_output([cuobjdump, "-sass", cubin], text=True), k.asm["ptx"]
            ix = lambda n: cx[fn.arg_names.index(n),]  # noqa: E731
            seen.append(dict(name=fn.fn.__name__, nbuf=ix("NBUF"), rk=ix("RK"), fb_once=ix("FB_ONCE"),
                             tma_load=ptx.count("cp.async.bulk.tensor.2d.shared::"),
                             tma_fb=ptx.count("cp.async.bulk.tensor.3d.shared::"),
                             tma_store=ptx.count("cp.async.bulk.tensor.2d.global.shared"),
                             store_wait=ptx.count("cp.async.bulk.wait_group.read"),
                             mbar_wait=ptx.count("mbarrier.try_wait.parity"), pdl=ptx.count("griddepcontrol.wait"),
                             local=sass.count("STL") + sass.count("LDL"), shared=k.metadata.shared,
                             triton=triton.__version__))
        else:
            seen.append(dict(name=fn.fn.__name__))
    print(json.dumps(seen))
""")


def _compiled(tr36: bool) -> list:
    """The build script's records, run in a subprocess (no interpreter) under this machine's Triton or 3.6."""
    env = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", "PYTHONPATH")}
    env.update({"PYTHONPATH": TR36} if tr36 else {})
    done = subprocess.run([sys.executable, "-c", _SM90_BUILD, ROOT], env=env, capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.splitlines()[-1])


@pytest.mark.parametrize("tr36", [False, True])
def test_gluon_launch_compiles_for_sm90_with_a_tma_ring(tr36):
    """The launcher's GLUON launches (the gate in the kernel, and f given by the GEMM) recorded and compiled for sm_90
    without spills; the PTX holds the prologue's NBUF - 1 TMA loads + the refills (one a half: one-token and other
    pairs' paths), the halves' TMA stores (2 a path), the store drains, the box waits and one PDL wait; with the gate
    in the kernel also f_b's head rows by one 3-d box (the prologue's, and where a program's pairs change heads each
    path's next-pair load) and their waits, the ring one box shorter (NBUF 5); shared memory holds the ring of
    [128, 64] fp32 boxes (and f_b's head rows). keep_states goes to the Triton kernel."""
    skip_without_triton36(tr36)
    seen = _compiled(tr36)
    want = "3.6" if tr36 else "3.7"
    g = [s for s in seen if s["name"] == "_kda_decode_gluon_kernel"]
    assert [(s["rk"], s["nbuf"], s["fb_once"]) for s in g] == [(128, 5, True), (0, 6, False), (128, 5, False)] and \
        g[0]["triton"].startswith(want), seen
    assert [s["name"] for s in seen if s not in g] == ["_kda_decode_kernel"], seen  # kept states: Triton
    for s in g:
        nb, inner = s["nbuf"], s["rk"] > 0
        assert s["local"] == 0, s
        assert s["tma_load"] == nb - 1 + 4 and s["tma_fb"] == inner * (1 if s["fb_once"] else 3), s
        assert s["tma_store"] == 4 and s["store_wait"] == 5, s
        assert s["mbar_wait"] >= 4 + 2 * inner and s["pdl"] == 1, s
        ring = nb * 128 * 64 * 4 + 128 * s["rk"] * 2
        assert ring <= s["shared"] <= ring + 8192, s


def _two_pass(S, k, q, g, v, beta):
    """The kernel's per-token arithmetic on one head, column half by column half (the halves' boxes): pred =
    S^T (e^g k); u = beta (v - pred); S = e^g S + k u^T; o = S^T q."""
    halves, outs = [], []
    for c in S.split(S.shape[1] // 2, dim=1):
        cols = slice(len(outs) * c.shape[1], (len(outs) + 1) * c.shape[1])
        u = beta * (v[cols] - c.T @ (g.exp() * k))
        c = g.exp()[:, None] * c + k[:, None] * u[None, :]
        halves.append(c)
        outs.append(c.T @ q)
    return torch.cat(halves, dim=1), torch.cat(outs)


def test_two_pass_form_equals_the_reference_recurrence_float64():
    """Two tokens of a random head in float64: the kernel's two-pass form on column halves gives the reference
    recurrence's outputs and final state (ir.ref.kda.kda_recurrence) to rounding."""
    gen = torch.Generator().manual_seed(int.from_bytes(os.urandom(2), "little"))
    D, T = 16, 2
    r = lambda *s: torch.randn(*s, generator=gen, dtype=torch.float64)  # noqa: E731
    q, k, v = r(T, 1, D), r(T, 1, D), r(T, 1, D)
    q, k = q / q.norm(dim=-1, keepdim=True), k / k.norm(dim=-1, keepdim=True)
    g = -torch.rand(T, 1, D, generator=gen, dtype=torch.float64) * 3
    beta = torch.rand(T, 1, generator=gen, dtype=torch.float64)
    pool = r(2, 1, D, D)
    S = pool[1, 0].clone()
    mine = []
    for t in range(T):
        S, o = _two_pass(S, k[t, 0], q[t, 0] * 0.5, g[t, 0], v[t, 0], beta[t, 0])
        mine.append(o)
    o_ref, _ = ref.kda_recurrence(q, k, v, g, beta, pool, torch.tensor([1]), torch.tensor([0, T]), 0.5,
                                  keep_states=True)
    assert torch.isfinite(S).all()
    torch.testing.assert_close(torch.stack(mine), o_ref[:, 0], rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(S, pool[1, 0], rtol=1e-12, atol=1e-12)


def test_usable_only_on_cuda_sm90_with_an_fp32_pool():
    """Never under the interpreter or without a GPU driver, nor for bf16 pools, kept states, rings that overflow
    shared memory, or pools whose rows pass int32 TMA coordinates."""
    st = torch.zeros(3, 2, 128, 128)
    assert not glu.usable(st, False)  # this CPU machine: the interpreter / no CUDA driver
    assert not glu.usable(st.bfloat16(), False) and not glu.usable(st, True)
    assert not glu.usable(torch.zeros(1, 1, 256, 256), False)
    assert glu.rows_fit(3, 2, 128) and not glu.rows_fit(1 << 17, 128, 128)


def test_head_grid_gives_each_program_one_head_without_more_pairs_a_program():
    """`grid`: one program per SM (at most one per pair); the head-aligned grid (GLUON 3) only where it keeps
    ceil(pairs / programs), and then every program's pairs c + i G share head c % H (checked by listing them)."""
    for NP, H, sms, head_grid in [(2048, 32, 132, True), (2048, 32, 132, False), (32, 32, 132, True),
                                  (135, 5, 132, True), (135, 5, 132, False), (2100, 32, 132, True),
                                  (384, 12, 132, True), (400, 3, 132, False), (7, 8, 4, True)]:
        G, one_head = glu.grid(NP, H, sms, head_grid)
        assert 1 <= G <= min(NP, sms)
        per = -(-NP // min(NP, sms))
        assert -(-NP // G) == per, (NP, H, G)  # never more pairs a program than one program per SM gives
        heads = [{p % H for p in range(c, NP, G)} for c in range(G)]
        assert one_head == all(len(x) == 1 for x in heads), (NP, H, G, one_head)
    assert glu.grid(2048, 32, 132, True) == (128, True) and glu.grid(2048, 32, 132, False) == (132, False)
    assert glu.grid(135, 5, 132, True) == (130, True) and glu.grid(2100, 32, 132, True) == (132, False)


def test_heuristic_takes_gluon_at_large_batches_only():
    """CUDA: GLUON 3 for one-token steps from 768 (request, head) pairs (B=64 H=32, B=32 H=32 and the rank preset's
    B=64 H=12: measured faster on the H200), not at the rank preset B=1 H=12 or B=32 H=12, nor B=1 H=32, nor at 16
    requests of 32 heads, nor in 8-token verification; never on CPU, nor in batch-invariant launches."""
    key = {"D": 128, "H": 32, "R": 64, "T": 64}
    big = heuristic(key, "cuda")
    assert big["GLUON"] == 3   # the gate in the Gluon kernel, head-aligned grid (GATE_MM: the Triton kernel's fallback)
    for more in ({"R": 256, "T": 256}, {"R": 32, "T": 32}, {"H": 12}):
        assert heuristic({**key, **more}, "cuda")["GLUON"] == 3, more
    for other in ({"H": 12, "R": 1, "T": 1}, {"H": 12, "R": 32, "T": 32}, {"R": 1, "T": 1}, {"R": 16, "T": 16},
                  {"T": 512}):
        assert heuristic({**key, **other}, "cuda")["GLUON"] == 0, other
    assert heuristic(key, "cpu")["GLUON"] == 0


def test_heuristic_warps_of_small_one_token_steps():
    """8 warps for a one-token step of at most 16 (request, head) pairs (the rank preset's B=1, chosen inside its decode
    graph), 4 for larger steps and for 8-token verification."""
    one = {"D": 128, "H": 12, "R": 1, "T": 1}
    assert heuristic(one, "cuda")["WARPS"] == 8
    for other in ({"T": 8}, {"R": 2, "T": 2}, {"H": 32}):
        assert heuristic({**one, **other}, "cuda")["WARPS"] == 4, other


def test_batch_invariant_launch_never_takes_gluon(monkeypatch):
    """The template's batch-invariant launch fixes GLUON 0 (its cuBLAS gate GEMM would make sums batch-dependent),
    even where the CUDA heuristic takes it; a plain launch passes the config's GLUON through."""
    import types

    from codegen.triton import kda_decode as kd
    from tests.kda_decode_case import decode_operands
    seen = []
    monkeypatch.setattr(kd, "kda_decode", lambda *a, **kw: seen.append(kw["gluon"]))
    monkeypatch.setattr(kd, "heuristic", lambda key, target: {**heuristic(key, "cuda"), "BV": 32})
    a = types.SimpleNamespace(operands=decode_operands(torch.Generator().manual_seed(1), 2, 32, [1], 8, 2))
    attrs = {"scale": 0.2, "lower_bound": -5.0, "norm_eps": 1e-5}
    kd._launch(a, {**attrs, "batch_invariant": True}, {})
    kd._launch(a, attrs, {"BV": 32, "WARPS": 4, "GLUON": 1})
    assert seen == [False, True]


def test_gate_in_the_kernel_only_for_gluon_2_with_a_16_bit_f_b(monkeypatch):
    """GLUON 2 / 3 hand f_a [T, r] and f_b to the Gluon launcher (the gate in the kernel; 3 on the head-aligned grid)
    when `lowrank_ok` takes f_b (16-bit, contiguous, r a multiple of 8 up to 2 D), with or without GATE_MM (the Triton
    kernel's switch); GLUON 1 and other f_b get f = f_a f_b^T [T, P] from the GEMM, equal to the float64 product to
    fp32 rounding."""
    from codegen.triton import kda_decode as kd
    from tests.kda_decode_case import decode_operands
    H, D = 2, 64
    ops = decode_operands(torch.Generator().manual_seed(int.from_bytes(os.urandom(2), "little")), H, D, [1, 2], D, 3)
    low = [x.to(torch.bfloat16) if i in (7, 8) else x for i, x in enumerate(ops)]
    seen = []
    monkeypatch.setattr(glu, "usable", lambda state, keep: True)
    monkeypatch.setattr(glu, "launch", lambda *a, **kw: seen.append((a[5], kw["f_b"], kw.get("head_grid", False))))
    run = lambda o, **kw: kd.kda_decode(*o, scale=0.1, lower_bound=-5.0, norm_eps=1e-5, **kw)  # noqa: E731
    run(low, gluon=2)
    run(low, gluon=2, gate_mm=True)
    run(low, gluon=3)  # the same, on the head-aligned grid
    assert [(f.shape, fb is low[8], hg) for f, fb, hg in seen] == [((3, D), True, False)] * 2 + [((3, D), True, True)]
    with pytest.raises(ValueError, match="GLUON 4"):
        run(low, gluon=4)
    seen.clear()
    run(low, gluon=1)
    run(ops, gluon=2)  # fp32 f_b
    run(low[:7] + [low[7][:, :12], low[8][:, :12].contiguous()] + low[9:], gluon=2)  # rank 12: not a multiple of 8
    assert all(fb is None and f.shape == (3, H * D) and f.dtype == torch.float32 for f, fb, _ in seen), seen
    want = low[7].double() @ low[8].double().T
    assert torch.isfinite(seen[0][0]).all()
    torch.testing.assert_close(seen[0][0].double(), want, rtol=1e-5, atol=1e-5)
    assert glu.lowrank_ok(low[8], D) and not glu.lowrank_ok(low[8], 16) and not glu.lowrank_ok(low[8].float(), D)
