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

Asynchronous decode (`async_decode=True`): while every running request is decoding and nothing waits to
be admitted, step N+1 is launched before step N's tokens are read: its tokens are the ids step N's sampler
left in the runtime's `token_feed` on the device (`ReferenceRuntime.fed`), so on a GPU the host's work
for a step (scheduling, metadata, launch, reading ids, stop checks) overlaps the device's. A request that
stops at step N (stop token, stop string) had one more token computed by step N+1; that row is
discarded. Requests that reach `max_new_tokens`, admissions, prefill chunks, growth that needs eviction
or preemption, cancellation: the engine resolves the step in flight and continues synchronously. The
tokens are the synchronous engine's.

Stop conditions: a stop token id, `max_new_tokens`, a stop string (decoded with the tokenizer). Requests
that cannot ever run (longer than the model context or the whole pool, bad sampling parameters, unknown
token ids) are refused by `add_request` with a RequestError; the engine keeps serving the others.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Iterator, Sequence

import torch

from .pinned import PinnedPair
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
class _Inflight:
    """A decode step launched and sampled on the device whose ids the host has not read yet."""
    seqs: list
    ids: torch.Tensor                 # the ids' host copy (pinned on a GPU), valid once `done` has completed
    done: object = None               # torch.cuda.Event recorded after that copy (None off the GPU)


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
                 tokenizer=None, keep_logits: bool = False, device_sampling: bool | None = None,
                 async_decode: bool = False):
        problems = [f"max_batched_tokens must be >= 1, found {max_batched_tokens}"] * (max_batched_tokens < 1) + \
            [f"prefill_chunk must be >= 1, found {prefill_chunk}"] * (prefill_chunk is not None and prefill_chunk < 1)
        if async_decode and getattr(runtime, "token_feed", None) is None:
            problems.append(f"async_decode needs a runtime with a device token feed (ReferenceRuntime or "
                            f"GraphedRuntime), not {type(runtime).__name__}")
        if problems:
            raise ValueError("engine: " + "; ".join(problems))
        self.rt = runtime
        self.async_decode = bool(async_decode)
        self._inflight: _Inflight | None = None
        n = len(runtime.token_feed) if getattr(runtime, "token_feed", None) is not None else len(runtime.free_slots)
        dev = getattr(runtime, "device", "cpu")
        # pinned buffers in turn: sampled ids to the host, sampling parameters and rows to the device
        self._ids, self._params, self._rows = (PinnedPair(n, torch.int64, dev), PinnedPair(3 * n, torch.float32, dev),
                                               PinnedPair(n, torch.int64, dev))
        self._greedy: torch.Tensor | None = None  # (temperature 0, top_p 1, u 0) rows kept on the device
        slots = len(runtime.free_slots)
        self.max_num_seqs = min(max_num_seqs or slots, slots)
        self.max_batched_tokens, self.prefill_chunk = max_batched_tokens, prefill_chunk
        self.tokenizer, self.keep_logits = tokenizer, keep_logits
        self.device_sampling = device_sampling  # None: the batched kernel when the logits are on a GPU
        self.cache = PrefixCache(runtime.blocks, runtime.block_size, has_state=bool(runtime.state_pools),
                                 interval=kda_checkpoint_interval) if prefix_caching else None
        self.waiting: deque[_Seq] = deque()
        self.running: list[_Seq] = []
        self.seqs: dict[str, _Seq] = {}
        self._ready: list[RequestOutput] = []   # outputs produced outside a step (cancel, zero tokens)
        self._order = 0
        self.kept_logits: dict[str, list[torch.Tensor]] = {}  # keep_logits: the logits each token was sampled from
        self.counters = {"steps": 0, "decode_calls": 0, "prefill_calls": 0, "preemptions": 0, "tokens_computed": 0,
                         "chained_decode_steps": 0}

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
        return bool(self.waiting or self.running or self._ready or self._inflight)

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
        if self._inflight is not None:
            nxt = self._chain()  # the next decode step, launched before the one in flight is read
            outputs += self._resolve()
            self._inflight = nxt
            if nxt is not None:
                return outputs
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
        if self.async_decode and not chunks:
            seqs = [s for s, _ in decodes]
            self._inflight = self._launch(seqs, [s.tokens[s.computed] for s in seqs])
            return outputs
        for fn, part in (("decode", decodes), ("prefill", chunks)):  # each kind through its own function
            if not part:
                continue
            logits = self.rt.step(fn, {s.rid: s.tokens[s.computed:s.computed + n] for s, n in part})
            self.counters[f"{fn}_calls"] += 1
            row, due = 0, []
            for s, n in part:
                row += n
                s.computed += n
                self._after_compute(s)
                if s.computed == len(s.tokens):
                    due.append((s, row - 1))
            outputs += self._sample(due, logits)
        return outputs

    # ---- asynchronous decode ------------------------------------------------------------------------
    def _launch(self, seqs: list[_Seq], tokens: list[int]) -> _Inflight:
        """Run a decode step of `seqs` and sample it on the device into the runtime's token feed; the ids'
        copy to the host is started, not waited for."""
        logits = self.rt.step("decode", {s.rid: [t] for s, t in zip(seqs, tokens)}, copy=False)
        self.counters["decode_calls"] += 1
        feed = self.rt.token_feed[:len(seqs)]
        self._draw(list(zip(seqs, range(len(seqs)))), logits, out=feed)
        if feed.device.type != "cuda":
            return _Inflight(seqs, feed.clone())
        host = self._ids.take(len(seqs))  # the buffer of two steps ago: already read
        host.copy_(feed, non_blocking=True)
        return _Inflight(seqs, host, self._ids.copied())

    def _chain(self) -> _Inflight | None:
        """Launch the next decode step of the requests in flight, fed by their pending ids, when nothing
        else is due: every running request is in it, none waits for admission, none reaches
        max_new_tokens with the pending token, and each has room for one more row without eviction."""
        seqs = self._inflight.seqs
        if len(seqs) != len(self.running) or any(self.seqs.get(s.rid) is not s for s in seqs):
            return None
        if self.waiting and len(self.running) < self.max_num_seqs:
            return None
        for s in seqs:
            if len(s.output) + 1 >= s.params.max_new_tokens or any(b > s.computed for b in s.checkpoints):
                return None
        for s in seqs:
            try:
                self.rt.grow(s.rid, s.computed + 2)  # the pending row, then this step's
            except PoolFull:
                return None
        self.counters["steps"] += 1
        self.counters["chained_decode_steps"] += 1
        self.counters["tokens_computed"] += len(seqs)
        return self._launch(seqs, [self.rt.fed(i) for i in range(len(seqs))])

    def _resolve(self) -> list[RequestOutput]:
        """Read the ids of the step in flight and finish its bookkeeping; rows of requests that ended since
        it was launched are discarded."""
        inf = self._inflight
        if inf.done is not None:
            inf.done.synchronize()
        live = [(s, t) for s, t in zip(inf.seqs, inf.ids.tolist()) if self.seqs.get(s.rid) is s]
        for s, _ in live:
            s.computed += 1
            self._after_compute(s)
        return self._emit_all(live)

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

    def _sample(self, due: list[tuple[_Seq, int]], logits: torch.Tensor) -> list[RequestOutput]:
        """Sample the next token of every request in `due` = [(seq, logits row)] and emit it."""
        if not due:
            return []
        return self._emit_all([(s, t) for (s, _), t in zip(due, self._draw(due, logits).tolist())])

    def _draw(self, due: list[tuple[_Seq, int]], logits: torch.Tensor, out: torch.Tensor | None = None):
        """The ids [len(due)] (on the logits' device, not read; written into `out` if given). On a GPU all
        rows go through one kernel (`codegen.triton.sampling.sample_tokens`; each request's uniform drawn
        from its own generator, greedy rows draw nothing; a row with NaN/inf logits gets -1); elsewhere each
        request's Sampler samples on the host (`device_sampling` forces either). Greedy picks are identical
        on both paths; seeded draws have the same distribution, not the same values."""
        if self.keep_logits:
            for s, r in due:
                self.kept_logits.setdefault(s.rid, []).append(logits[r].detach().to("cpu", torch.float32).clone())
        on_device = logits.device.type == "cuda" if self.device_sampling is None else self.device_sampling
        if not on_device:
            ids = torch.tensor([s.sampler.sample(logits[r]) for s, r in due], dtype=torch.int64)
            return ids if out is None else out.copy_(ids)
        from codegen.triton.sampling import sample_tokens

        n, dev = len(due), logits.device
        rows = [r for _, r in due]
        # nothing here may wait for the device (a pageable host->device copy would): the rows of a decode
        # step are its first n, and the sampling parameters travel through pinned buffers
        x = logits[:n] if rows == list(range(n)) else logits.index_select(0, self._to_device(self._rows, [rows], dev)[0])
        if all(s.params.temperature == 0 for s, _ in due):
            t, p, u = self._greedy_params(n, dev)
        else:
            u = [float(torch.rand((), generator=s.sampler.generator)) if s.params.temperature > 0 else 0.0
                 for s, _ in due]
            t, p, u = self._to_device(self._params, [[s.params.temperature for s, _ in due],
                                                     [s.params.top_p for s, _ in due], u], dev)
        return sample_tokens(x, t, p, u, check=False, out=out)

    def _greedy_params(self, n: int, dev) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(temperature 0, top_p 1, u 0) for n rows, kept on the device."""
        c = self._greedy
        if c is None or c.shape[1] < n or c.device != dev:
            c = self._greedy = torch.tensor([[0.0], [1.0], [0.0]], device=dev).repeat(1, max(n, len(self.rt.token_feed)))
        return c[0, :n], c[1, :n], c[2, :n]

    @staticmethod
    def _to_device(pair: PinnedPair, table: list[list], dev) -> torch.Tensor:
        """A small host table on the device by an asynchronous copy out of `pair`'s next pinned buffer."""
        host = torch.tensor(table, dtype=pair.bufs[0].dtype)
        if dev.type != "cuda":
            return host.to(dev)
        buf = pair.take(host.numel()).view(host.shape)
        buf.copy_(host)
        out = buf.to(dev, non_blocking=True)
        pair.copied()
        return out

    def _emit_all(self, picked: list[tuple[_Seq, int]]) -> list[RequestOutput]:
        bad = [s.rid for s, t in picked if t < 0]
        if bad:
            raise FloatingPointError(f"logits of requests {bad[:8]} contain NaN or inf; refusing to sample")
        return [out for s, tok in picked for out in self._emit(s, tok)]

    def _emit(self, s: _Seq, tok: int) -> list[RequestOutput]:
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
