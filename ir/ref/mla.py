"""Literal torch reference semantics of MLA attention over a latent cache pool (SPEC §4).

Context rule (shared with ``ir.ref.indexer``): token i of request r = token_req[i] at position
p_i = token_pos[i] attends to positions 0..p_i of its request, stored at the pool rows the paged
block table gives (``ir.ref.paging``: row = block_table[r, p // bs] * bs + p % bs); or, when
``selection`` is given, exactly the positions listed in selection[i] (entries -1 are padding; entries
are positions, must be distinct and <= p_i).  With ``selection_kind="rows"`` the entries are the
physical pool rows instead (what the fused indexer emits); ``selection_rows_to_positions`` maps them back.
"""

from __future__ import annotations

import torch

from .paging import cache_rows, read_rows, rows_to_positions

__all__ = ["mla_attention", "mla_absorb", "mla_value_proj", "context_positions", "selection_positions_to_rows",
           "selection_rows_to_positions"]

# Upper bound on the elements of one token block's gathered-context intermediates; the
# reference processes tokens in blocks so that long prefill contexts stay within memory.
_BLOCK_ELEMS = 1 << 26


def context_positions(token_pos: torch.Tensor, selection: torch.Tensor | None):
    """(positions [B, L] int64, valid [B, L] bool) of each token's context.

    Dense: L = max(token_pos)+1, positions 0..L-1, valid where position <= token_pos.
    Selection: positions = selection, valid where selection >= 0; raises ValueError when a
    valid entry is > token_pos (non-causal).
    """
    tp = token_pos.to(torch.int64)
    if selection is None:
        L = int(tp.max().item()) + 1 if tp.numel() else 0
        pos = torch.arange(L, device=tp.device, dtype=torch.int64).expand(tp.numel(), L)
        valid = pos <= tp.unsqueeze(1)
        return pos, valid
    sel = selection.to(device=tp.device, dtype=torch.int64)
    if sel.dim() != 2 or sel.shape[0] != tp.numel():
        raise ValueError(f"selection must be [B, K], got {tuple(sel.shape)}")
    valid = sel >= 0
    if bool((valid & (sel > tp.unsqueeze(1))).any()):
        raise ValueError("selection holds a position after the token's own (non-causal)")
    return sel, valid


def selection_positions_to_rows(selection: torch.Tensor, token_req: torch.Tensor, block_table: torch.Tensor,
                                block_size: int) -> torch.Tensor:
    """rows[i, j] = row(token_req[i], selection[i, j]) where selection[i, j] >= 0, else -1."""
    sel = selection.to(torch.int64)
    valid = sel >= 0
    req = token_req.to(device=sel.device, dtype=torch.int64).unsqueeze(1)
    rows = cache_rows(block_table, block_size, req, torch.where(valid, sel, 0))
    return torch.where(valid, rows, torch.full_like(sel, -1))


def selection_rows_to_positions(rows: torch.Tensor, token_req: torch.Tensor, block_table: torch.Tensor,
                                block_size: int) -> torch.Tensor:
    """Inverse of ``selection_positions_to_rows``; raises ValueError for a valid row in a block its
    token's request does not own (a row of another request)."""
    return rows_to_positions(rows, block_table, block_size, token_req)


def mla_value_proj(o_latent: torch.Tensor, kv_b_w: torch.Tensor, nope_dim: int) -> torch.Tensor:
    """o^h = W_UV^h o~^h: o_latent [B, H, kv] (the absorbed attention's latent output), kv_b_w
    [H*(dn+dv), kv] (layout as in ``mla_attention``), nope_dim = dn.  Returns [B, H, dv] in
    o_latent's dtype."""
    B, H, kv = o_latent.shape
    if kv_b_w.shape[1] != kv or kv_b_w.shape[0] % H:
        raise ValueError(f"kv_b_w {tuple(kv_b_w.shape)} does not match o_latent {tuple(o_latent.shape)}")
    dv = kv_b_w.shape[0] // H - nope_dim
    if dv <= 0:
        raise ValueError(f"nope_dim {nope_dim} leaves no value rows in kv_b_w {tuple(kv_b_w.shape)}")
    W_UV = kv_b_w.to(o_latent.dtype).view(H, nope_dim + dv, kv)[:, nope_dim:]
    return torch.einsum("bhk,hvk->bhv", o_latent, W_UV)


def _token_blocks(n_tokens: int, per_token: int):
    bs = max(1, _BLOCK_ELEMS // max(1, per_token))
    for s in range(0, n_tokens, bs):
        yield s, min(n_tokens, s + bs)


def mla_absorb(q_nope: torch.Tensor, kv_b_w: torch.Tensor) -> torch.Tensor:
    """q~ [B, H, kv] = W_UK^T q_nope per head, in q_nope's dtype (kv_b_w cast to it): the query side that
    ``mla_attention``'s absorbed form computes (it calls this)."""
    B, H, dn = q_nope.shape
    kv = kv_b_w.shape[1]
    W_UK = kv_b_w.to(q_nope.dtype).view(H, kv_b_w.shape[0] // H, kv)[:, :dn]
    return torch.einsum("bhn,hnk->bhk", q_nope, W_UK)


def mla_attention(q_nope: torch.Tensor, q_pe: torch.Tensor, latent: torch.Tensor,
                  kv_b_w: torch.Tensor, token_pos: torch.Tensor, token_req: torch.Tensor,
                  block_table: torch.Tensor, block_size: int, scale: float, selection: torch.Tensor | None = None,
                  form: str = "absorbed", selection_kind: str = "positions", nope_dim: int | None = None) -> torch.Tensor:
    """MLA attention for a ragged batch of tokens against a latent cache pool.

    q_nope [B, H, dn], q_pe [B, H, dr]; latent pool rows [c_KV (normalised); k_pe], flat [N, kv+dr]
    or a block view [NB, block_size, kv+dr] (``ir.ref.paging``);
    kv_b_w [H*(dn+dv), kv] in DeepSeek's kv_b_proj layout (view(H, dn+dv, kv): first dn rows of
    head h are W_UK^h, next dv rows W_UV^h).  token_pos/token_req [B], block_table [R, MB] with
    block_size rows per block (``ir.ref.paging``).

    score_h(t,s) = scale*(q_nope^h . W_UK^h c(s) + q_pe^h . k_pe(s)); p = softmax over the
    context; o^h = sum_s p(s) W_UV^h c(s).
      form="absorbed":     q~ = [W_UK^T q_nope ; q_pe] against latent rows, o~ = sum p c, o = W_UV o~.
      form="decompressed": k_nope, v materialised per context token.
      form="latent":       the absorbed form without the final W_UV product: returns o~ [B, H, kv]
                           (``mla_value_proj`` applies W_UV).
    selection_kind: "positions" (request positions) or "rows" (physical pool rows).
    nope_dim (absorbed / latent forms only): q_nope already holds q~ = W_UK^T q_nope [B, H, kv] (``mla_absorb``)
    and nope_dim is dn.
    The current token's own latent row must already be in the pool.  Computes in q_nope's
    dtype (latent / kv_b_w are cast to it).  Returns o [B, H, dv] (o~ [B, H, kv] for "latent").
    """
    if form not in ("absorbed", "decompressed", "latent"):
        raise ValueError(f"form must be 'absorbed', 'decompressed' or 'latent', got {form!r}")
    if selection_kind not in ("positions", "rows"):
        raise ValueError(f"selection_kind must be 'positions' or 'rows', got {selection_kind!r}")
    if selection is not None and selection_kind == "rows":
        selection = selection_rows_to_positions(selection, token_req, block_table, block_size)
    B, H, dn = q_nope.shape
    if nope_dim is not None:
        if form == "decompressed" or dn != kv_b_w.shape[1]:
            raise ValueError(f"an absorbed query (nope_dim given) is [B, H, kv={kv_b_w.shape[1]}] in the absorbed "
                             f"or latent form, got {tuple(q_nope.shape)} with form {form!r}")
        dn = nope_dim
    dr = q_pe.shape[-1]
    dt, dev = q_nope.dtype, q_nope.device
    kv = kv_b_w.shape[1]
    if latent.shape[-1] != kv + dr:
        raise ValueError(f"latent rows must be kv+dr = {kv + dr} wide, got {latent.shape[-1]}")
    if kv_b_w.shape[0] % H:
        raise ValueError("kv_b_w rows must be a multiple of H")
    dv = kv_b_w.shape[0] // H - dn
    Wkv = kv_b_w.to(dt).view(H, dn + dv, kv)
    W_UK, W_UV = Wkv[:, :dn], Wkv[:, dn:]                    # [H, dn, kv], [H, dv, kv]
    q_pe = q_pe.to(dt)

    pos, valid = context_positions(token_pos.to(dev), selection)
    if B and not bool(valid.any(dim=1).all()):
        raise ValueError("a token has an empty attention context")
    req = token_req.to(device=dev, dtype=torch.int64)
    o = q_nope.new_zeros(B, H, kv if form == "latent" else dv)
    L = pos.shape[1]
    per_tok = L * (kv + dr + H * (dn + dv + 1))
    for s, e in _token_blocks(B, per_tok):
        m = valid[s:e]
        rows = cache_rows(block_table, block_size, req[s:e].unsqueeze(1), torch.where(m, pos[s:e], 0))  # [b, L]
        ctx = read_rows(latent, rows, block_size).to(dt)                 # [b, L, kv+dr]
        c, kpe = ctx[..., :kv], ctx[..., kv:]
        rope_part = torch.einsum("bhr,blr->bhl", q_pe[s:e], kpe)
        if form in ("absorbed", "latent"):
            q_abs = q_nope[s:e] if nope_dim is not None else mla_absorb(q_nope[s:e], kv_b_w)
            logits = scale * (torch.einsum("bhk,blk->bhl", q_abs, c) + rope_part)
            p = torch.softmax(logits.masked_fill(~m.unsqueeze(1), float("-inf")), dim=-1)
            o_lat = torch.einsum("bhl,blk->bhk", p, c)
            o[s:e] = o_lat if form == "latent" else torch.einsum("bhk,hvk->bhv", o_lat, W_UV)
        else:
            k_nope = torch.einsum("blk,hnk->blhn", c, W_UK)
            v = torch.einsum("blk,hvk->blhv", c, W_UV)
            logits = scale * (torch.einsum("bhn,blhn->bhl", q_nope[s:e], k_nope) + rope_part)
            p = torch.softmax(logits.masked_fill(~m.unsqueeze(1), float("-inf")), dim=-1)
            o[s:e] = torch.einsum("bhl,blhv->bhv", p, v)
    return o
