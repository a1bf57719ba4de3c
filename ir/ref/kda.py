"""Literal torch reference semantics of the KDA layer's sequence ops (SPEC §3).

Batch layout (shared by all of ``ir.ref``): a step holds B tokens of R requests, token-major;
request r owns rows ``cu_seqlens[r]:cu_seqlens[r+1]`` (consecutive positions, ascending).
Recurrent-state pools (conv tails, KDA states) are indexed by ``state_slot[r]``.  The slots of
the requests in one call must be distinct.  A fresh request must find its slot zeroed (the
runtime zeroes slots at allocation; these functions never decide "fresh").

Pools are updated IN PLACE; the functions return only the new activations.  Pool entries are
read in the pool's dtype, cast to the compute dtype (that of the activations), and written back
cast to the pool's dtype (so a bf16 state pool rounds once per call, as the runtime would).
Rows of the pool that belong to slots not listed in ``state_slot`` are never touched.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

__all__ = ["causal_conv1d", "kda_gate", "kda_recurrence", "kda_chunked"]


def _seq_meta(cu_seqlens: torch.Tensor, n_tokens: int):
    """(lengths[R] int64 tensor, token_req[B], token_local_index[B], python lengths list)."""
    cu = cu_seqlens.to(torch.int64)
    if cu.dim() != 1 or cu.numel() < 1:
        raise ValueError("cu_seqlens must be int64[R+1]")
    lengths = cu[1:] - cu[:-1]
    lens = lengths.tolist()
    if any(l < 0 for l in lens) or int(cu[0]) != 0 or int(cu[-1]) != n_tokens:
        raise ValueError(f"bad cu_seqlens {cu.tolist()} for {n_tokens} tokens")
    dev = cu.device
    token_req = torch.repeat_interleave(torch.arange(len(lens), device=dev), lengths)
    local = torch.arange(n_tokens, device=dev) - cu[:-1][token_req]
    return lengths, token_req, local, lens


def causal_conv1d(x: torch.Tensor, weight: torch.Tensor, conv_state: torch.Tensor,
                  state_slot: torch.Tensor, cu_seqlens: torch.Tensor, keep_states: bool = False):
    """Depthwise causal conv (no bias) followed by SiLU, per request.

    x: [B, C]; weight: [C, K] (tap K-1 multiplies the current token, tap 0 the oldest, as
    ``F.conv1d`` with K-1 left padding); conv_state: pool [S, K-1, C] holding each request's
    last K-1 inputs, oldest first (zeros for a fresh request); state_slot: [R]; cu_seqlens: [R+1].

    y[t] = silu(sum_j weight[:, j] * ctx[t - (K-1) + j]) where ctx is the request's inputs
    preceded by its conv_state row.  Returns y [B, C] in x's dtype.

    In place: conv_state[state_slot[r]] <- the last K-1 inputs of request r's context (old
    state included when the request has fewer than K-1 new tokens).
    With keep_states=True returns (y, tails): tails [B, K-1, C] in conv_state's dtype, row t the
    conv tail after token t (what conv_state would hold had the step stopped there).
    """
    B, C = x.shape
    K = weight.shape[-1]
    if weight.shape != (C, K):
        raise ValueError(f"conv weight must be [C={C}, K], got {tuple(weight.shape)}")
    if conv_state.shape[1:] != (K - 1, C):
        raise ValueError(f"conv_state must be [S, {K - 1}, {C}], got {tuple(conv_state.shape)}")
    lengths, token_req, local, _ = _seq_meta(cu_seqlens, B)
    slots = state_slot.to(device=x.device, dtype=torch.int64)
    cu0 = cu_seqlens.to(device=x.device, dtype=torch.int64)[:-1]
    st = conv_state[slots].to(x.dtype)                       # [R, K-1, C]
    w = weight.to(x.dtype)

    def gather_ctx(req: torch.Tensor, src: torch.Tensor) -> torch.Tensor:
        """ctx value at local index ``src`` (may be negative -> state) of request ``req``."""
        from_x = x[(cu0[req] + src).clamp(0, max(B - 1, 0))] if B > 0 else \
            x.new_zeros(src.shape[0], C)
        from_st = st[req, (src + (K - 1)).clamp(0, K - 2)] if K > 1 else from_x
        return torch.where((src >= 0).unsqueeze(-1), from_x, from_st)

    acc = torch.zeros_like(x)
    for j in range(K):
        acc = acc + gather_ctx(token_req, local - (K - 1) + j) * w[:, j]
    y = F.silu(acc)

    if K > 1 and slots.numel() > 0:
        R = slots.numel()
        req = torch.arange(R, device=x.device).repeat_interleave(K - 1)
        m = torch.arange(K - 1, device=x.device).repeat(R)
        src = lengths.to(x.device)[req] - (K - 1) + m        # last K-1 local indices
        new = gather_ctx(req, src).view(R, K - 1, C)
        tails = None
        if keep_states:  # computed before the pool rows are overwritten
            tok = torch.arange(B, device=x.device).repeat_interleave(K - 1)
            src_t = local[tok] - (K - 2) + torch.arange(K - 1, device=x.device).repeat(B)
            tails = gather_ctx(token_req[tok], src_t).view(B, K - 1, C).to(conv_state.dtype)
        conv_state[slots] = new.to(conv_state.dtype)
        return (y, tails) if keep_states else y
    if keep_states:
        return y, x.new_zeros(B, max(K - 1, 0), C).to(conv_state.dtype)
    return y


def kda_gate(f: torch.Tensor, A_log: torch.Tensor, dt_bias: torch.Tensor | None,
             lower_bound: float | None) -> torch.Tensor:
    """Forget gate in log space. f: [B, H*D], A_log: [H], dt_bias: [H*D] -> g [B, H, D].

    lower_bound given (K3): g = lower_bound * sigmoid(exp(A_log[h]) * (f + dt_bias)).
    None (Kimi-Linear):     g = -exp(A_log[h]) * softplus(f + dt_bias)  (torch softplus,
    threshold 20, as fla / transformers).  Computed in f's dtype.
    """
    H = A_log.numel()
    x = f.reshape(*f.shape[:-1], H, -1)
    if dt_bias is not None:
        x = x + dt_bias.to(f.dtype).view(H, -1)
    a = torch.exp(A_log.to(f.dtype)).view(H, 1)
    if lower_bound is None:
        return -a * F.softplus(x)
    return float(lower_bound) * torch.sigmoid(a * x)


def _check_kda_shapes(q, k, v, g, beta, state):
    B, H, D = q.shape
    Dv = v.shape[-1]
    if k.shape != (B, H, D) or g.shape != (B, H, D) or v.shape != (B, H, Dv) \
            or beta.shape != (B, H):
        raise ValueError("kda: q,k,g must be [B,H,D], v [B,H,Dv], beta [B,H]")
    if state.shape[1:] != (H, D, Dv):
        raise ValueError(f"kda: state pool must be [S,{H},{D},{Dv}], got {tuple(state.shape)}")
    return B, H, D, Dv


def kda_recurrence(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                   beta: torch.Tensor, state: torch.Tensor, state_slot: torch.Tensor,
                   cu_seqlens: torch.Tensor, scale: float, keep_states: bool = False):
    """Token-by-token KDA recurrence (the literal definition, SPEC §3.6).

    q, k: [B, H, D] (already L2-normalised); v: [B, H, Dv]; g: [B, H, D] (log decay);
    beta: [B, H]; state: pool [S, H, D, Dv] (rows = key channels); state_slot: [R];
    cu_seqlens: [R+1].  Per token:
        S' = diag(exp(g)) S;   S = S' + beta k (v - S'^T k)^T;   o = S^T (q * scale).
    Each request starts from state[state_slot[r]]; its final state is written back IN PLACE.

    Returns o [B, H, Dv] (compute dtype = q's dtype); with keep_states=True returns
    (o, states) with states [B, H, D, Dv] the state after each token.
    """
    B, H, D, Dv = _check_kda_shapes(q, k, v, g, beta, state)
    dt = q.dtype
    _, _, _, lens = _seq_meta(cu_seqlens, B)
    cu0 = cu_seqlens.to(device=q.device, dtype=torch.int64)[:-1]
    lengths = torch.tensor(lens, device=q.device, dtype=torch.int64)
    slots = state_slot.to(device=q.device, dtype=torch.int64)
    qs = q * scale
    k, v, g, beta = k.to(dt), v.to(dt), g.to(dt), beta.to(dt)
    S = state[slots].to(dt).clone()                          # [R, H, D, Dv]
    o = q.new_zeros(B, H, Dv)
    states = q.new_zeros(B, H, D, Dv) if keep_states else None
    for t in range(max(lens, default=0)):
        act = torch.nonzero(lengths > t).squeeze(-1)         # requests still running
        rows = cu0[act] + t
        Sa = S[act] * torch.exp(g[rows]).unsqueeze(-1)       # S'
        kt = k[rows]
        pred = torch.einsum("rhd,rhdv->rhv", kt, Sa)         # S'^T k
        delta = beta[rows].unsqueeze(-1) * (v[rows] - pred)
        Sa = Sa + kt.unsqueeze(-1) * delta.unsqueeze(-2)
        o[rows] = torch.einsum("rhd,rhdv->rhv", qs[rows], Sa)
        S[act] = Sa
        if keep_states:
            states[rows] = Sa
    if slots.numel() > 0:
        state[slots] = S.to(state.dtype)
    return (o, states) if keep_states else o


def kda_chunked(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                beta: torch.Tensor, state: torch.Tensor, state_slot: torch.Tensor,
                cu_seqlens: torch.Tensor, scale: float, chunk_size: int = 64) -> torch.Tensor:
    """KDA in chunked WY / UT form; same signature and semantics as :func:`kda_recurrence`.

    Within a chunk of length C with initial state S0 and inclusive cumulative log decay
    G_t = sum_{i<=t} g_i (per key channel), the recurrence unrolls to
        S_t = diag(e^{G_t}) S0 + sum_{i<=t} diag(e^{G_t - G_i}) k_i d_i^T,
        d_t = beta_t (v_t - S'_t^T k_t)                    (the delta-rule "new values").
    Substituting S'_t gives the unit-lower-triangular system (UT transform)
        (I + A) d = beta*V - beta*(e^{G} * K) S0,   A_ti = beta_t sum_c k_tc k_ic e^{G_tc - G_ic}, i<t,
    so d = U - W S0 with U = (I+A)^-1 beta V, W = (I+A)^-1 beta (e^G * K)  (WY form).  Then
        o_t = (e^{G_t} * q_t)^T S0 + sum_{i<=t} P_ti d_i,  P_ti = sum_c q_tc k_ic e^{G_tc - G_ic},
        S_C = diag(e^{G_C}) S0 + (e^{G_C - G} * K)^T d.
    Pairwise decays are formed as exp of differences (never e^{G} e^{-G}), so nothing overflows.

    Requests are ragged: each is cut into chunks from its first token, the last chunk partial.
    Partial chunks are padded with q = k = v = g = beta = 0 tokens, which are exact no-ops
    (d = 0, decay e^0 = 1).  Chunks with the same index of all requests are processed together.
    Final states are written back to state[state_slot] IN PLACE.  Returns o [B, H, Dv].
    """
    B, H, D, Dv = _check_kda_shapes(q, k, v, g, beta, state)
    if chunk_size < 1:
        raise ValueError("chunk_size must be >= 1")
    dt, dev = q.dtype, q.device
    _, _, _, lens = _seq_meta(cu_seqlens, B)
    R = len(lens)
    C = int(chunk_size)
    slots = state_slot.to(device=dev, dtype=torch.int64)
    S = state[slots].to(dt).clone()                          # [R, H, D, Dv]
    o = q.new_zeros(B, H, Dv)
    n_chunks = max((l + C - 1) // C for l in lens) if R and max(lens) > 0 else 0
    if n_chunks == 0:
        if slots.numel() > 0:
            state[slots] = S.to(state.dtype)
        return o

    # Padded token grid [R, n_chunks*C]: row index into the batch and validity.
    L = n_chunks * C
    cu0 = cu_seqlens.to(device=dev, dtype=torch.int64)[:-1]
    lengths = torch.tensor(lens, device=dev, dtype=torch.int64)
    pos = torch.arange(L, device=dev)
    valid = pos.unsqueeze(0) < lengths.unsqueeze(1)          # [R, L]
    rows = (cu0.unsqueeze(1) + pos.unsqueeze(0)).clamp(max=max(B - 1, 0))

    def grid(t: torch.Tensor) -> torch.Tensor:
        """[B, H, ...] -> [R, n_chunks, H, C, ...] with zero padding."""
        x = t.to(dt)[rows]                                   # [R, L, H, ...]
        x = x * valid.view(R, L, *([1] * (x.dim() - 2))).to(dt)
        x = x.view(R, n_chunks, C, *x.shape[2:])
        return x.transpose(2, 3)                             # [R, N, H, C, ...]

    qg, kg, vg, gg, bg = grid(q * scale), grid(k), grid(v), grid(g), grid(beta)
    causal_incl = torch.tril(torch.ones(C, C, dtype=torch.bool, device=dev))
    strict = torch.tril(torch.ones(C, C, dtype=torch.bool, device=dev), diagonal=-1)
    eye = torch.eye(C, dtype=dt, device=dev)
    og = q.new_zeros(R, n_chunks, H, C, Dv)

    for n in range(n_chunks):
        qc, kc, vc, bc = qg[:, n], kg[:, n], vg[:, n], bg[:, n]   # [R, H, C, *]
        G = torch.cumsum(gg[:, n], dim=-2)                        # [R, H, C, D] inclusive
        # pairwise decay e^{G_t - G_i} for i <= t (t: rows, i: cols), 0 above the diagonal
        diff = G.unsqueeze(-2) - G.unsqueeze(-3)                  # [R, H, C(t), C(i), D]
        diff = diff.masked_fill(~causal_incl.unsqueeze(-1), float("-inf"))
        E = torch.exp(diff)
        kk = torch.einsum("rhtc,rhtic,rhic->rhti", kc, E, kc)
        A = (bc.unsqueeze(-1) * kk).masked_fill(~strict, 0.0)    # strictly lower
        P = torch.einsum("rhtc,rhtic,rhic->rhti", qc, E, kc)     # inclusive lower
        M = eye + A
        eG = torch.exp(G)
        U = torch.linalg.solve_triangular(M, bc.unsqueeze(-1) * vc, upper=False,
                                          unitriangular=True)
        W = torch.linalg.solve_triangular(M, bc.unsqueeze(-1) * (eG * kc), upper=False,
                                          unitriangular=True)
        d = U - W @ S                                             # [R, H, C, Dv]
        og[:, n] = (eG * qc) @ S + P @ d
        G_last = G[:, :, -1:, :]                                  # [R, H, 1, D]
        kdec = torch.exp(G_last - G) * kc                         # [R, H, C, D]
        S = torch.exp(G_last).transpose(-1, -2) * S + kdec.transpose(-1, -2) @ d

    flat = og.transpose(2, 3).reshape(R, L, H, Dv)
    o[rows[valid]] = flat[valid]
    state[slots] = S.to(state.dtype)
    return o
