"""The simple runtime path: executes the model's IR with the reference interpreter.

Caches are paged: every MLA/indexer pool is a table of rows grouped in blocks of the module's
`block_size`; a request owns a list of blocks (its block table, `ir.ref.paging`) covering its capacity (`grow` adds more),
and one row (its slot) of every KDA state pool. Blocks are reference-counted (`blocks.BlockAllocator`),
so a cached prefix's blocks can be shared. The pools are read from the module's function signatures
(every input after the step metadata), so this runtime knows nothing about the model.

Allocation (DESIGN §5 T1): when the pool inputs are block views [NB, bs, *row] (the default build), ONE
packed `BlockPool` holds them: a block is one contiguous byte row with every layer's latent and
index-key page (`block_layout.layout_for_pools`, placed as plan.json's `cache_layout`), and the KDA
state / conv pools are views of its slot pool. Every pool input is handed a typed view of those two
allocations, so the in-place cache writes land in the packed rows. A module built with flat pools
([N, *row], `BuildOptions(pool_view="flat")`) gets one tensor per pool, as before.

    rt = ReferenceRuntime(module, weights, max_rows=1024, max_requests=4)
    rt.add_request("a", capacity=64)
    logits = rt.prefill({"a": [1, 2, 3]})          # [3, vocab]
    logits = rt.decode({"a": 7})                    # [1, vocab]
    out = generate(rt, [[1, 2, 3]], SamplingParams(max_new_tokens=8))
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Mapping, Sequence

import torch

from ir.core import Module
from ir.dtypes import WIDENED_FLOATS
from ir.interpreter import Interpreter
from ir.shapes import evaluate

from .sampling import Sampler, SamplingParams
from .step_metadata import StepMetadataBuilder, check_step, host_metadata

from .block_layout import BlockLayout, layout_for_pools
from .block_pool import BlockPool
from .blocks import BlockAllocator, BlocksExhausted

METADATA = ("tokens", "token_pos", "token_req", "cu_seqlens", "block_table", "state_slot")


class RequestError(ValueError):
    """A request or step the runtime cannot serve; the message says which and why."""


class PoolFull(RequestError):
    """Not enough free cache blocks right now (a scheduler may free some and retry)."""


@dataclass
class _Request:
    rid: str
    slot: int
    capacity: int
    blocks: list[int] = field(default_factory=list)
    length: int = 0


class ReferenceRuntime:
    def __init__(self, module: Module, weights: Mapping, *, max_rows: int = 4096, max_requests: int = 8,
                 compute_dtype: torch.dtype = torch.float32, device: str = "cpu", engine: Interpreter | None = None):
        """`engine` runs the entry functions: the reference interpreter by default, or a compiled
        `k31c.runtime.executor.Executor` (kernels) over the same module."""
        self.module = module
        self.interp = engine or Interpreter(module, weights, compute_dtype, device)
        self.device, self.compute_dtype = self.interp.device, self.interp.compute_dtype  # pools live with the engine
        fn = module.function("prefill")
        names = [v.name for v in fn.inputs]
        if tuple(names[:len(METADATA)]) != METADATA:
            raise RequestError(f"module @{module.name}: prefill inputs must start with {METADATA}, found {names[:6]}")
        self.vocab_size = int(fn.outputs[0].type.shape[1])
        self.max_context = int(_module_config(module).get("max_position_embeddings", 1 << 62))
        self.block_size = int(module.attrs.get("block_size", 1))
        if max_rows < 1:
            raise RequestError(f"max_rows must be positive, found {max_rows}")
        # max_rows tokens in all, plus one block per request slot for rounding each request to whole blocks
        num_blocks = -(-max_rows // self.block_size) + max_requests
        env = {"N": num_blocks * self.block_size, "NB": num_blocks, "S": max_requests}
        self.layout_source = "flat pools: one tensor per pool input, no packed row"  # see _packed_pool
        self.block_pool = self._packed_pool(fn, num_blocks, max_requests)
        self.pools: dict[str, torch.Tensor] = {}
        for v in fn.inputs[len(METADATA):]:
            if self.block_pool is not None:
                self.pools[v.name] = self.block_pool.pool_view(v.name)
            else:
                dims = [evaluate(d, env) for d in v.type.shape]
                self.pools[v.name] = torch.zeros(dims, dtype=self._held_dtype(v), device=self.device)
        self.state_pools = [n for n, t in self.pools.items() if _leading_symbol(fn, n) == "S"]
        self.blocks = self.block_pool.allocator if self.block_pool is not None else BlockAllocator(num_blocks)
        self.pool_copies = 0  # pools an engine returned in new memory (copied back into the packed pool)
        self.free_slots = list(range(max_requests))
        # where a sampler on the device leaves a step's ids; a decode token -1 - i reads token_feed[i]
        self.token_feed = torch.zeros(max_requests, dtype=torch.int64, device=self.device)
        self.requests: dict[str, _Request] = {}
        self._metadata_builder = None  # StepMetadataBuilder, made at the first GPU step
        # rows of a request this pool stores: every position here; a DCP rank stores its share only
        # (`k31c.parallel.serving.use_local_cache_rows` sets it)
        self.rows_for = lambda tokens: tokens

    def _held_dtype(self, v) -> torch.dtype:
        name = v.type.dtype.name
        return self.interp.float_dtype(name) if name in WIDENED_FLOATS else v.type.dtype.torch_dtype

    def _packed_pool(self, fn, num_blocks: int, max_requests: int) -> BlockPool | None:
        """The packed BlockPool when every MLA pool input is a block view [NB, block_size, *row] (None for
        flat pools); KDA state / conv pools [S, ...] become its slot pool."""
        pools = fn.inputs[len(METADATA):]
        blocked = [v for v in pools if _leading_symbol(fn, v.name) == "NB"]
        if not blocked:
            return None
        block_pools, slot_pools, bad = [], [], []
        for v in pools:
            shape = v.type.shape
            held = _LAYOUT_DTYPE.get(self._held_dtype(v))
            lead = _leading_symbol(fn, v.name)
            if lead == "NB" and held and len(shape) >= 2 and shape[1] == self.block_size:
                block_pools.append((v.name, held, tuple(int(d) for d in shape[2:])))
            elif lead == "S" and held:
                slot_pools.append((v.name, held, tuple(int(d) for d in shape[1:])))
            else:
                bad.append(f"%{v.name}: {v.type}")
        if bad:
            raise RequestError(f"module @{self.module.name}: pool inputs {bad} are neither block views "
                               f"[NB, {self.block_size}, ...] nor per-request slots [S, ...] of a known dtype")
        planned = self.module.attrs.get("cache_layout")
        if planned is None:
            layout = layout_for_pools(self.module.name, self.block_size, block_pools, slot_pools)
            self.layout_source = "derived from the IR pools (module without a planned cache_layout)"
        else:
            plan = BlockLayout.from_json(json.loads(planned))
            layout = layout_for_pools(self.module.name, self.block_size, block_pools, slot_pools,
                                      alignment=plan.alignment, tp=plan.tp)
            if layout == plan:
                self.layout_source = "the module's planned cache_layout (plan.json)"
            else:  # only an engine that holds a pool in another dtype (the reference interpreter widening bf16)
                self.layout_source = (f"derived from the pools as this engine holds them ({layout.row_bytes} B "
                                      f"rows; the planned cache_layout has {plan.row_bytes} B rows)")
        return BlockPool(layout, num_blocks, max_requests, self.device)

    # ---- request lifetime --------------------------------------------------------------------
    def blocks_for(self, tokens: int) -> int:
        """Blocks a request of `tokens` tokens takes: its `rows_for(tokens)` stored rows in whole blocks."""
        return -(-self.rows_for(tokens) // self.block_size)

    def add_request(self, rid: str, capacity: int, prefix_blocks: Sequence[int] = (), prefix_len: int = 0):
        """Admit a request that may grow to `capacity` tokens; blocks for all of them are taken now.
        `prefix_blocks` (already cached, whole blocks holding positions [0, prefix_len)) are shared,
        not copied: the request starts at length `prefix_len` and its own blocks follow them."""
        if rid in self.requests:
            raise RequestError(f"request {rid!r} already exists")
        if capacity > self.max_context:
            raise RequestError(f"request {rid!r}: {capacity} tokens exceed the model context {self.max_context}")
        if not self.free_slots:
            raise RequestError(f"request {rid!r}: all {len(self.requests)} request slots are in use")
        if prefix_len > len(prefix_blocks) * self.block_size or prefix_len > capacity:
            raise RequestError(f"request {rid!r}: a prefix of {prefix_len} tokens does not fit its "
                               f"{len(prefix_blocks)} blocks / capacity {capacity}")
        need = self.blocks_for(capacity) - len(prefix_blocks)
        try:
            own = self.blocks.allocate(max(0, need))
        except BlocksExhausted as e:
            raise PoolFull(f"request {rid!r}: {capacity} tokens need {self.blocks_for(capacity)} cache blocks "
                               f"of {self.block_size} rows: {e}") from e
        self.blocks.share(prefix_blocks)
        slot = self.free_slots.pop(0)
        for name in self.state_pools:
            self.pools[name][slot].zero_()
        self.requests[rid] = _Request(rid, slot, capacity, list(prefix_blocks) + own, prefix_len)

    def release(self, rid: str) -> list[int]:
        """End a request; returns the blocks that became free."""
        r = self.requests.pop(rid, None)
        if r is None:
            raise RequestError(f"unknown request {rid!r}")
        self.free_slots.append(r.slot)
        self.free_slots.sort()
        return self.blocks.release(r.blocks)

    def length(self, rid: str) -> int:
        return self.requests[rid].length

    def grow(self, rid: str, capacity: int):
        """Let request `rid` hold `capacity` tokens: takes the extra blocks now (RequestError, with the
        allocator's BlocksExhausted as cause, when the pool has too few; nothing changes then)."""
        r = self.requests[rid]
        if capacity > self.max_context:
            raise RequestError(f"request {rid!r}: {capacity} tokens exceed the model context {self.max_context}")
        need = self.blocks_for(capacity) - len(r.blocks)
        if need > 0:
            try:
                r.blocks += self.blocks.allocate(need)
            except BlocksExhausted as e:
                raise PoolFull(f"request {rid!r}: growing to {capacity} tokens needs {need} more cache "
                                   f"blocks: {e}") from e
        r.capacity = max(r.capacity, capacity)

    def blocks_of(self, rid: str) -> list[int]:
        return list(self.requests[rid].blocks)

    def snapshot_state(self, rid: str) -> dict[str, torch.Tensor]:
        """Copies of the request's recurrent state (every KDA state and conv-tail pool row)."""
        slot = self.requests[rid].slot
        return {name: self.pools[name][slot].clone() for name in self.state_pools}

    def restore_state(self, rid: str, snapshot: dict[str, torch.Tensor]):
        slot = self.requests[rid].slot
        for name in self.state_pools:
            self.pools[name][slot].copy_(snapshot[name])

    # ---- steps -------------------------------------------------------------------------------
    def prefill(self, chunks: Mapping[str, Sequence[int]]) -> torch.Tensor:
        return self.step("prefill", chunks)

    def decode(self, tokens: Mapping[str, int]) -> torch.Tensor:
        """One token per request; a token -1 - i is the id at `token_feed[i]` (`fed(i)`), written there by a
        sampler on the device after the previous step (no host round trip in between on the graph path)."""
        return self.step("decode", {rid: [t] for rid, t in tokens.items()})

    @staticmethod
    def fed(i: int) -> int:
        """The decode token that stands for `token_feed[i]`."""
        return -1 - int(i)

    def verify(self, drafts: Mapping[str, Sequence[int]]) -> torch.Tensor:
        """Score 1–8 draft tokens per request; `accept` then keeps a prefix of each request's drafts."""
        self._last_verify = None
        logits = self.step("verify", drafts)
        fn = self.module.function("verify")
        extra = {v.name: t for v, t in zip(fn.outputs[1 + len(self.pools):], self._last_outs[1 + len(self.pools):])}
        cu = [0]
        for toks in drafts.values():
            cu.append(cu[-1] + len(toks))
        self._last_verify = {"rows": {rid: (cu[i], len(t)) for i, (rid, t) in enumerate(drafts.items())},
                             "states": extra}
        return logits

    def accept(self, rid: str, n: int):
        """Keep the first n (>= 1) draft tokens of request rid's last verify step: its length rolls back to
        them and every recurrent state pool row takes the state after draft token n (the verify function's
        per-token outputs `<pool>.per_token`, returned when kda_decode_fusion ran with keep_states)."""
        lv = getattr(self, "_last_verify", None)
        if lv is None or rid not in lv["rows"]:
            raise RequestError(f"accept: request {rid!r} was not in the last verify step")
        start, count = lv["rows"][rid]
        if not 1 <= n <= count:
            raise RequestError(f"accept: request {rid!r} verified {count} draft tokens; keep 1..{count}, not {n}")
        r = self.requests[rid]
        missing = [p for p in self.state_pools if f"{p}.per_token" not in lv["states"]]
        if missing and n < count:
            raise RequestError(f"accept: this module's verify returns no per-token states for {missing[:2]}...; "
                               f"compile it (the kda_decode_fusion pass keeps them) to roll back recurrent state")
        if n < count:
            for p in self.state_pools:
                self.pools[p][r.slot].copy_(lv["states"][f"{p}.per_token"][start + n - 1])
        r.length -= count - n

    def step(self, fn: str, chunks: Mapping[str, Sequence[int]], copy: bool = True) -> torch.Tensor:
        """Run one entry function over {request: new tokens}; returns logits [total tokens, vocab] (fresh
        here whatever `copy` says; a graphed runtime may hand out its graph's buffer when copy=False)."""
        meta = self._metadata(fn, chunks)
        outs = self.interp.run(fn, {**meta, **self.pools})
        self._last_outs = outs
        for name, t in zip(self.pools, outs[1:]):
            if self.block_pool is None:
                self.pools[name] = t
            elif not _same_memory(t, self.pools[name]):  # the pools are the packed pool's views: keep them
                self.pools[name].copy_(t)
                self.pool_copies += 1
        for rid, toks in chunks.items():
            self.requests[rid].length += len(toks)
        return outs[0]

    def _metadata(self, fn: str, chunks: Mapping[str, Sequence[int]]) -> dict[str, torch.Tensor]:
        """The step's metadata tensors (RequestError naming every problem): on a GPU one copy and one fused
        kernel (`step_metadata.StepMetadataBuilder`), else built on the host."""
        rows = check_step(self, fn, chunks)
        if self.device.type != "cuda":
            return host_metadata(rows, self.device)
        if self._metadata_builder is None:
            self._metadata_builder = StepMetadataBuilder(self.device)
        return self._metadata_builder.build(rows)


def generate(rt: ReferenceRuntime, prompts: Sequence[Sequence[int]], params: SamplingParams | Sequence[SamplingParams],
             prefill_chunk: int | None = None) -> list[list[int]]:
    """Prefill every prompt (in chunks of `prefill_chunk` tokens if given), then decode them together."""
    plist = list(params) if isinstance(params, (list, tuple)) else [params] * len(prompts)
    rids = [f"req{i}" for i in range(len(prompts))]
    samplers, outputs = {}, {}
    for rid, prompt, p in zip(rids, prompts, plist):
        if len(prompt) == 0:
            raise ValueError(f"{rid}: empty prompt; give at least one token")
        rt.add_request(rid, len(prompt) + p.max_new_tokens)
        samplers[rid], outputs[rid] = Sampler(p), []
    try:
        last = {}
        step = prefill_chunk or max(len(p) for p in prompts)
        for start in range(0, max(len(p) for p in prompts), step):
            chunks = {rid: list(pr[start:start + step]) for rid, pr in zip(rids, prompts) if len(pr) > start}
            logits = rt.prefill(chunks)
            ends = torch.tensor([len(c) for c in chunks.values()]).cumsum(0) - 1
            last.update({rid: logits[e] for rid, e in zip(chunks, ends.tolist())})
        active = [rid for rid, p in zip(rids, plist) if p.max_new_tokens > 0]
        while active:
            nxt = {}
            for rid in active:
                tok = samplers[rid].sample(last[rid])
                outputs[rid].append(tok)
                p = samplers[rid].params
                if tok not in p.stop_token_ids and len(outputs[rid]) < p.max_new_tokens:
                    nxt[rid] = tok
            active = list(nxt)
            if active:
                logits = rt.decode(nxt)
                last = {rid: logits[i] for i, rid in enumerate(active)}
    finally:
        for rid in rids:
            if rid in rt.requests:
                rt.release(rid)
    return [outputs[rid] for rid in rids]


def _module_config(module: Module) -> dict:
    return json.loads(module.attrs.get("config", "{}"))


_LAYOUT_DTYPE = {torch.uint8: "u8", torch.float8_e4m3fn: "e4m3", torch.bfloat16: "bf16", torch.float16: "f16",
                 torch.float32: "f32", torch.float64: "f64"}


def _same_memory(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.data_ptr() == b.data_ptr() and a.shape == b.shape and a.stride() == b.stride() and a.dtype == b.dtype


def _leading_symbol(fn, name: str) -> str:
    v = fn.input(name)
    return str(v.type.shape[0])
