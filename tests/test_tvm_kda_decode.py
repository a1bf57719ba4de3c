"""TVM fused KDA decode (codegen/tvm/kda_decode.py) vs the unfused op sequence it replaces, through ir.ref
(conv + SiLU, L2, gate, recurrence, gated RMSNorm), on ragged requests (0..9 tokens each), both gate
variants, with and without dt_bias / o_norm_w; the state pools are updated in place, untouched rows stay;
with keep_states (verification) the per-token states and conv tails equal the reference's."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("tvm", reason="apache-tvm is a test extra; the TVM backend needs it")

from codegen.tvm import kda_decode as K  # noqa: E402
from ir.ref import kda as ref  # noqa: E402
from ir.ref.basic import gated_rms_norm, l2_norm  # noqa: E402
from tests.helpers import assert_close_rel  # noqa: E402

(TEMPLATE,) = K.TEMPLATES


def _cu(lengths):
    return torch.tensor([0] + list(torch.tensor(lengths).cumsum(0).tolist()), dtype=torch.int64)


def _operands(gen, H, D, lengths, rank, S, bias=True, norm_w=True):
    r = lambda *s: torch.randn(*s, generator=gen)  # noqa: E731
    T, P, KW = sum(lengths), H * D, 4
    slots = torch.randperm(S, generator=gen)[:len(lengths)]
    return [r(T, P), r(T, P), r(T, P), r(P, KW) * 0.5, r(P, KW) * 0.5, r(P, KW) * 0.5, r(S, KW - 1, 3 * P), r(T, rank),
            r(P, rank) / rank ** 0.5, r(H) * 0.5, r(P) if bias else None, r(T, H), r(S, H, D, D) * 0.5,
            r(T, P), r(D) if norm_w else None, slots, _cu(lengths)]


def _unfused(ops, scale, lb, eps, keep=False):
    """The group passes/kda_decode_fusion.py replaces, op by op through ir.ref (float64); with keep also the
    recurrence's per-token states."""
    q, k, v, qc, kc, vc, conv, f_a, f_b, A_log, dt_bias, b, state, gate, w, slots, cu = ops
    T, P = q.shape
    H = A_log.numel()
    D = P // H
    y = ref.causal_conv1d(torch.cat([q, k, v], 1), torch.cat([qc, kc, vc], 0), conv, slots, cu)
    qh, kh = l2_norm(y[:, :P].reshape(T, H, D), 1e-6), l2_norm(y[:, P:2 * P].reshape(T, H, D), 1e-6)
    g = ref.kda_gate(f_a @ f_b.T, A_log, dt_bias, lb)
    o = ref.kda_recurrence(qh, kh, y[:, 2 * P:].reshape(T, H, D), g, torch.sigmoid(b), state, slots, cu, scale,
                           keep_states=keep)
    o, states = o if keep else (o, None)
    out = gated_rms_norm(o, gate.reshape(T, H, D), w, eps).reshape(T, P)
    return (out, states) if keep else out


def _conv_tails(ops, lengths):
    """The conv tail after every token: the reference conv fed one token at a time."""
    q, k, v, qc, kc, vc, conv = ops[:7]
    conv, x, w = conv.clone(), torch.cat([q, k, v], 1), torch.cat([qc, kc, vc], 0)
    slots, cu, out = ops[15], ops[16], []
    for r in range(len(lengths)):
        for t in range(int(cu[r]), int(cu[r + 1])):
            ref.causal_conv1d(x[t:t + 1], w, conv, slots[r:r + 1], torch.tensor([0, 1]))
            out.append(conv[slots[r]].clone())
    return torch.stack(out)


def _run(ops, H, D, lb, config, keep=False):
    attrs = {"heads": H, "head_dim": D, "scale": D ** -0.5, "lower_bound": lb, "l2_eps": 1e-6, "norm_eps": 1e-5,
             "batch_invariant": False, "keep_states": keep}
    a = SimpleNamespace(operands=ops)
    key = TEMPLATE.key_dims(a, attrs)
    cfg = config or TEMPLATE.heuristic(key, "cpu")
    assert TEMPLATE.constraints(cfg, key, "cpu") == []
    return TEMPLATE.launch(a, attrs, cfg)


@pytest.mark.parametrize("H,D,lengths,lb,bias,norm_w", [
    (2, 16, [1, 1, 1], -5.0, True, True),               # decode: one token per request
    (2, 16, [1, 3, 0, 8, 2], -5.0, True, False),        # verification, ragged, an empty request
    (1, 64, [2, 1, 9], None, False, True),              # the tiny model's head size, softplus gate
])
def test_decode_vs_unfused_reference(H, D, lengths, lb, bias, norm_w):
    g = torch.Generator().manual_seed(31 + H * D + len(lengths))
    S = len(lengths) + 2
    ops = _operands(g, H, D, lengths, 8, S, bias, norm_w)
    mine = [x.clone() if isinstance(x, torch.Tensor) else x for x in ops]
    want = [x.double().clone() if isinstance(x, torch.Tensor) and x.is_floating_point() else
            (x.clone() if isinstance(x, torch.Tensor) else x) for x in ops]
    out, conv, state = _run(mine, H, D, lb, None)
    y_ref = _unfused(want, D ** -0.5, lb, 1e-5)
    assert conv is mine[6] and state is mine[12]
    assert_close_rel(out, y_ref, 2e-5, "fused decode output")
    assert_close_rel(state, want[12], 2e-5, "kda state pool")
    assert_close_rel(conv, want[6], 1e-7, "conv state pool")
    others = [s for s in range(S) if s not in ops[15].tolist()]
    assert torch.equal(state[others], ops[12][others]) and torch.equal(conv[others], ops[6][others])


def test_verification_keeps_per_token_states():
    """keep_states (verify): results 4 and 5 are the state and the conv tail after every token."""
    g = torch.Generator().manual_seed(41)
    H, D, lengths = 2, 16, [3, 1, 0, 5]
    ops = _operands(g, H, D, lengths, 8, 6)
    mine = [x.clone() if isinstance(x, torch.Tensor) else x for x in ops]
    want = [x.double().clone() if isinstance(x, torch.Tensor) and x.is_floating_point() else
            (x.clone() if isinstance(x, torch.Tensor) else x) for x in ops]
    out, conv, state, states, tails = _run(mine, H, D, -5.0, None, keep=True)
    y_ref, states_ref = _unfused(want, D ** -0.5, -5.0, 1e-5, keep=True)
    assert_close_rel(out, y_ref, 2e-5, "verify output")
    assert_close_rel(states, states_ref, 2e-5, "per-token states")
    assert_close_rel(tails, _conv_tails(ops, lengths), 1e-7, "per-token conv tails")
    assert_close_rel(conv, want[6], 1e-7, "conv state pool")


def test_every_config_gives_the_same_result():
    """Every declared value of every tunable compiles and gives the heuristic's result."""
    g = torch.Generator().manual_seed(5)
    H, D, lengths = 2, 16, [1, 2, 1]
    ops = _operands(g, H, D, lengths, 4, 4)
    configs = [{"VEC": vec, "PAR": 1} for vec in TEMPLATE.tunables[0].values] + [{"VEC": 16, "PAR": 2}]
    assert {c["PAR"] for c in configs} == set(TEMPLATE.tunables[1].values)
    results = [_run([x.clone() if isinstance(x, torch.Tensor) else x for x in ops], H, D, -5.0, c) for c in configs]
    for out, conv, state in results[1:]:
        assert_close_rel(out, results[0][0], 1e-6, "output across configs")
        assert_close_rel(state, results[0][2], 1e-6, "state across configs")


def test_supports_names_what_it_cannot_run(monkeypatch):
    monkeypatch.setenv("K31C_TVM", "all")
    g = torch.Generator().manual_seed(6)
    ops = _operands(g, 2, 16, [1], 4, 2)
    a = SimpleNamespace(operands=ops)
    assert TEMPLATE.supports(a, {"scale": 0.25, "norm_eps": 1e-5}, "cpu") is None
    assert TEMPLATE.supports(a, {"scale": 0.25, "norm_eps": 1e-5, "keep_states": True}, "cpu") is None
    assert "required" in TEMPLATE.supports(a, {"scale": 0.25}, "cpu")
    assert "host CPU" in TEMPLATE.supports(a, {"scale": 0.25, "norm_eps": 1e-5}, "h200")
