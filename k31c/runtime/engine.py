"""The serving engine: continuous batching over a paged runtime (DESIGN §5 T1, T8).

    eng = Engine(runtime, max_batched_tokens=64, prefix_caching=True)
    eng.add_request("a", prompt_ids, SamplingParams(max_new_tokens=16, seed=1), stop=["\\n"])
    for out in eng.stream():          # RequestOutput per request per step (new tokens, finish reason)
        ...

Every step the scheduler spends a token budget (`max_batched_tokens`): first one token for each running
request that is decoding and the next chunk of each running request still prefilling (chunks are cut at
`prefill_chunk` and at the request's KDA checkpoint boundaries), then it admits waiting requests (at most
`max_num_seqs` run at once) while the budget and the free cache blocks allow; admission reuses a cached
prefix when prefix caching is on. In a step, the requests decoding one token run through the model's
`decode` function and the prefill chunks (one ragged batch) through `prefill`.

Cache blocks are taken as requests grow. When none are free, unreferenced prefix-cache blocks are evicted
(LRU), then the most recently admitted running request is preempted: its blocks and state are released and
it returns to the front of the queue; on re-admission it recomputes prompt + generated tokens and then
continues sampling (its seeded generator is untouched by the recompute, so its output is unchanged).

Stop conditions: a stop token id, `max_new_tokens`, a stop string (decoded with the tokenizer). Requests
that cannot ever run (longer than the model context or the whole pool, bad sampling parameters, unknown
token ids) are refused by `add_request` with a RequestError; the engine keeps serving the others.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Iterator, Sequence

import torch

from .prefix_cache import PrefixCache, extend_hashes
from .reference import PoolFull, ReferenceRuntime, RequestError
from .sampling import Sampler, SamplingParams


@dataclass
class RequestOutput:
    rid: str
    new_tokens: list[int]
    tokens: list[int]                  # every token generated so far
    finished: bool = False
    finish_reason: str | None = None   # "stop" | "length" | "stop_string" | "cancelled"


@dataclass
class _Seq:
    rid: str
    prompt: list[int]
    params: SamplingParams
    stop: tuple[str, ...]
    sampler: Sampler
    order: int
    output: list[int] = field(default_factory=list)
    computed: int = 0                  # tokens whose cache entries are written
    admitted: bool = False
    checkpoints: list[int] = field(default_factory=list)
    hashes: list = field(default_factory=list)   # prefix-cache chain hashes of the computed full blocks

    @property
    def tokens(self) -> list[int]:
        return self.prompt + self.output


class Engine:
    def __init__(self, runtime: ReferenceRuntime, *, max_num_seqs: int | None = None, max_batched_tokens: int = 256,
                 prefill_chunk: int | None = None, prefix_caching: bool = False, kda_checkpoint_interval: int = 0,
                 tokenizer=None, keep_logits: bool = False):
        problems = [f"max_batched_tokens must be >= 1, found {max_batched_tokens}"] * (max_batched_tokens < 1) + \
            [f"prefill_chunk must be >= 1, found {prefill_chunk}"] * (prefill_chunk is not None and prefill_chunk < 1)
        if problems:
            raise ValueError("engine: " + "; ".join(problems))
        self.rt = runtime
        slots = len(runtime.free_slots)
        self.max_num_seqs = min(max_num_seqs or slots, slots)
        self.max_batched_tokens, self.prefill_chunk = max_batched_tokens, prefill_chunk
        self.tokenizer, self.keep_logits = tokenizer, keep_logits
        self.cache = PrefixCache(runtime.blocks, runtime.block_size, has_state=bool(runtime.state_pools),
                                 interval=kda_checkpoint_interval) if prefix_caching else None
        self.waiting: deque[_Seq] = deque()
        self.running: list[_Seq] = []
        self.seqs: dict[str, _Seq] = {}
        self._ready: list[RequestOutput] = []   # outputs produced outside a step (cancel, zero tokens)
        self._order = 0
        self.kept_logits: dict[str, list[torch.Tensor]] = {}  # keep_logits: the logits each token was sampled from
        self.counters = {"steps": 0, "decode_calls": 0, "prefill_calls": 0, "preemptions": 0, "tokens_computed": 0}

    # ---- requests -------------------------------------------------------------------------------
    def add_request(self, rid: str, prompt: Sequence[int], params: SamplingParams = SamplingParams(),
                    stop: Sequence[str] = ()):
        rt, problems = self.rt, []
        prompt = [int(t) for t in prompt]
        if rid in self.seqs:
            problems.append(f"request id {rid!r} is already in use")
        if not prompt:
            problems.append("the prompt is empty; give at least one token")
        bad = [t for t in prompt if not 0 <= t < rt.vocab_size]
        if bad:
            problems.append(f"token ids {bad[:5]} outside the vocabulary [0, {rt.vocab_size})")
        problems += params.problems()
        total = len(prompt) + params.max_new_tokens
        if total > rt.max_context:
            problems.append(f"prompt {len(prompt)} + max_new_tokens {params.max_new_tokens} = {total} tokens exceed "
                            f"the model context {rt.max_context}")
        if rt.blocks_for(total) > rt.blocks.num_blocks:
            problems.append(f"{total} tokens need {rt.blocks_for(total)} cache blocks of {rt.block_size}; the whole "
                            f"pool has {rt.blocks.num_blocks} (compile with a larger pool or lower max_new_tokens)")
        if stop and self.tokenizer is None:
            problems.append("stop strings need a tokenizer (Engine(..., tokenizer=...))")
        if problems:
            raise RequestError(f"request {rid!r} refused: " + "; ".join(problems))
        seq = _Seq(rid, prompt, params, tuple(stop), Sampler(params), self._order)
        self._order += 1
        self.seqs[rid] = seq
        if params.max_new_tokens == 0:
            self._finish(seq, "length")
        else:
            self.waiting.append(seq)

    def cancel(self, rid: str):
        seq = self.seqs.get(rid)
        if seq is None:
            raise RequestError(f"cancel: unknown request id {rid!r} (never added, or already finished and reported)")
        if seq in self.waiting:
            self.waiting.remove(seq)
        self._finish(seq, "cancelled")

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running or self._ready)

    def stream(self) -> Iterator[RequestOutput]:
        while self.has_unfinished():
            yield from self.step()

    def run_to_completion(self) -> dict[str, RequestOutput]:
        final = {}
        for out in self.stream():
            if out.finished:
                final[out.rid] = out
        return final

    # ---- one step -------------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        outputs, self._ready = self._ready, []
        batch = self._schedule()
        if not batch:
            if self.waiting and not self.running:
                raise RuntimeError(f"engine: {len(self.waiting)} requests wait but none can be admitted "
                                   f"({self.rt.blocks.num_free} free blocks)")
            return outputs
        self.counters["steps"] += 1
        self.counters["tokens_computed"] += sum(n for _, n in batch)
        decodes = [(s, n) for s, n in batch if n == 1 and s.computed > 0]
        chunks = [(s, n) for s, n in batch if not (n == 1 and s.computed > 0)]
        for fn, part in (("decode", decodes), ("prefill", chunks)):  # each kind through its own function
            if not part:
                continue
            logits = self.rt.step(fn, {s.rid: s.tokens[s.computed:s.computed + n] for s, n in part})
            self.counters[f"{fn}_calls"] += 1
            row = 0
            for s, n in part:
                row += n
                s.computed += n
                self._after_compute(s)
                if s.computed == len(s.tokens):
                    outputs += self._sample(s, logits[row - 1])
        return outputs

    def _schedule(self) -> list[tuple[_Seq, int]]:
        budget, batch = self.max_batched_tokens, []
        for s in list(self.running):
            if budget == 0:
                break
            if s not in self.running:
                continue  # preempted while making room for an earlier request
            n = self._chunk(s, budget)
            if self._ensure(s, s.computed + n, batch):
                batch.append((s, n))
                budget -= n
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            s = self.waiting[0]
            if not self._admit(s):
                break
            self.waiting.popleft()
            self.running.append(s)
            n = self._chunk(s, budget)
            if not self._ensure(s, s.computed + n, batch):
                break  # s went back to the queue: nothing later can be admitted this step
            batch.append((s, n))
            budget -= n
        return batch

    def _chunk(self, s: _Seq, budget: int) -> int:
        n = min(len(s.tokens) - s.computed, budget, self.prefill_chunk or budget)
        nxt = [b for b in s.checkpoints if b > s.computed]
        return min(n, nxt[0] - s.computed) if nxt else n

    def _admit(self, s: _Seq) -> bool:
        rt, toks = self.rt, s.tokens
        match = self.cache.match(toks) if self.cache else None
        if self.cache:
            s.checkpoints = self.cache.checkpoint_boundaries(toks, match.tokens)
            self.cache.note_prompt(s.prompt)
        blocks, start = (match.blocks, match.tokens) if match else ([], 0)
        while True:
            try:
                rt.add_request(s.rid, start + 1, prefix_blocks=blocks, prefix_len=start)
                break
            except PoolFull:
                need = rt.blocks_for(start + 1) - len(blocks)
                if not (self.cache and self.cache.evict(need)):
                    return False
        if match is not None and match.state is not None:
            rt.restore_state(s.rid, match.state)
        s.computed, s.admitted = start, True
        return True

    def _ensure(self, s: _Seq, capacity: int, batch: list) -> bool:
        """Blocks for `capacity` tokens of s: evict cached prefixes, then preempt later requests."""
        while True:
            try:
                self.rt.grow(s.rid, capacity)
                return True
            except PoolFull:
                need = self.rt.blocks_for(capacity) - len(self.rt.blocks_of(s.rid))
                if self.cache and self.cache.evict(need):
                    continue
                victims = [v for v in self.running if v is not s]
                if not victims:
                    raise
                victim = max(victims, key=lambda v: v.order)
                if victim.order < s.order:  # s is the latest: it waits instead
                    self._preempt(s)
                    return False
                for i, (v, _) in enumerate(batch):
                    if v is victim:
                        del batch[i]
                        break
                self._preempt(victim)

    def _preempt(self, s: _Seq):
        self.rt.release(s.rid)
        self.running.remove(s)
        s.computed, s.admitted, s.checkpoints = 0, False, []
        self.waiting.appendleft(s)
        self.counters["preemptions"] += 1

    def _after_compute(self, s: _Seq):
        if self.cache is None:
            return
        extend_hashes(s.hashes, s.tokens[:s.computed], self.rt.block_size)  # tokens never change: hashes stay valid
        self.cache.insert_blocks(s.hashes, self.rt.blocks_of(s.rid))
        if s.computed in s.checkpoints and s.computed % self.rt.block_size == 0:
            self.cache.store_state(s.hashes[:s.computed // self.rt.block_size], self.rt.snapshot_state(s.rid))

    def _sample(self, s: _Seq, logits: torch.Tensor) -> list[RequestOutput]:
        if self.keep_logits:
            self.kept_logits.setdefault(s.rid, []).append(logits.detach().to("cpu", torch.float32).clone())
        tok = s.sampler.sample(logits)
        s.output.append(tok)
        reason = None
        if tok in s.params.stop_token_ids:
            reason = "stop"
        elif s.stop and any(x in self.tokenizer.decode(s.output) for x in s.stop):
            reason = "stop_string"
        elif len(s.output) >= s.params.max_new_tokens:
            reason = "length"
        if reason is None:
            return [RequestOutput(s.rid, [tok], list(s.output))]
        self._finish(s, reason, emit=False)
        return [RequestOutput(s.rid, [tok], list(s.output), True, reason)]

    def _finish(self, s: _Seq, reason: str, emit: bool = True):
        if s.admitted:
            self.rt.release(s.rid)
            s.admitted = False
        if s in self.running:
            self.running.remove(s)
        del self.seqs[s.rid]
        if emit:
            self._ready.append(RequestOutput(s.rid, [], list(s.output), True, reason))

    def stats(self) -> dict:
        out = dict(self.counters, free_blocks=self.rt.blocks.num_free, total_blocks=self.rt.blocks.num_blocks)
        if self.cache:
            out["prefix_cache"] = self.cache.stats.to_json()
            out["prefix_cache"]["held_blocks"] = self.cache.held_blocks
        return out
