"""One fused-KDA-decode test case, shared by the Triton and TVM kernel tests: random operands in the order
`passes/kda_decode_fusion.py` documents, and the unfused group it replaces, run op by op through ir.ref."""

from __future__ import annotations

import torch

from ir.ref import kda as ref
from ir.ref.basic import gated_rms_norm, l2_norm


def cu(lengths) -> torch.Tensor:
    """cu_seqlens int64 [R+1] of per-request token counts."""
    return torch.tensor([0] + torch.tensor(lengths).cumsum(0).tolist(), dtype=torch.int64)


def decode_operands(gen, H, D, lengths, rank, S, bias=True, norm_w=True) -> list:
    """The fused node's 17 operands for requests of `lengths` tokens (conv width 4, low-rank gate of `rank`,
    S state slots of which each request takes a random one)."""
    r = lambda *s: torch.randn(*s, generator=gen)  # noqa: E731
    T, P, K = sum(lengths), H * D, 4
    slots = torch.randperm(S, generator=gen)[:len(lengths)]
    return [r(T, P), r(T, P), r(T, P), r(P, K) * 0.5, r(P, K) * 0.5, r(P, K) * 0.5, r(S, K - 1, 3 * P), r(T, rank),
            r(P, rank) / rank ** 0.5, r(H) * 0.5, r(P) if bias else None, r(T, H), r(S, H, D, D) * 0.5,
            r(T, P), r(D) if norm_w else None, slots, cu(lengths)]


def unfused_decode(ops, scale, lb, eps):
    """(output [T, P], per-token states) of the group `passes/kda_decode_fusion.py` replaces; updates the
    conv and state pools in `ops` in place, as the group does. f_b None: f_a is the gate input already."""
    q, k, v, qc, kc, vc, conv, f_a, f_b, A_log, dt_bias, b, state, gate, w, slots, cu_ = ops
    T, P = q.shape
    H = A_log.numel()
    D = P // H
    y = ref.causal_conv1d(torch.cat([q, k, v], 1), torch.cat([qc, kc, vc], 0), conv, slots, cu_)
    qh, kh = l2_norm(y[:, :P].reshape(T, H, D), 1e-6), l2_norm(y[:, P:2 * P].reshape(T, H, D), 1e-6)
    g = ref.kda_gate(f_a @ f_b.T if f_b is not None else f_a, A_log, dt_bias, lb)
    o, states = ref.kda_recurrence(qh, kh, y[:, 2 * P:].reshape(T, H, D), g, torch.sigmoid(b), state, slots, cu_,
                                   scale, keep_states=True)
    return gated_rms_norm(o, gate.reshape(T, H, D), w, eps).reshape(T, P), states


def conv_tails(ops, lengths) -> torch.Tensor:
    """The conv tail after every token: the reference conv fed one token at a time."""
    q, k, v, qc, kc, vc, conv = ops[:7]
    conv, x, w = conv.clone(), torch.cat([q, k, v], 1), torch.cat([qc, kc, vc], 0)
    slots, cu_, out = ops[15], ops[16], []
    for r in range(len(lengths)):
        for t in range(int(cu_[r]), int(cu_[r + 1])):
            ref.causal_conv1d(x[t:t + 1], w, conv, slots[r:r + 1], torch.tensor([0, 1]))
            out.append(conv[slots[r]].clone())
    return torch.stack(out)
