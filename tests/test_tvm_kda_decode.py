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
from tests.helpers import assert_close_rel  # noqa: E402
from tests.kda_decode_case import conv_tails as _conv_tails  # noqa: E402
from tests.kda_decode_case import decode_operands as _operands  # noqa: E402
from tests.kda_decode_case import unfused_decode as _unfused  # noqa: E402

(TEMPLATE,) = K.TEMPLATES


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
    y_ref = _unfused(want, D ** -0.5, lb, 1e-5)[0]
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
    y_ref, states_ref = _unfused(want, D ** -0.5, -5.0, 1e-5)
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
