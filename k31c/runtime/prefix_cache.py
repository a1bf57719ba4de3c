"""Hybrid prefix caching (DESIGN §5 T8): reuse a shared prompt's latent pages, index keys AND KDA state.

Latent pages and index keys live in the same cache blocks, so one content hash per full block covers
both: h_j = sha256(h_{j-1} || tokens of block j). The cache holds one reference on every block it
indexes (`BlockAllocator.share`), so a finished request's blocks survive it.

KDA layers carry a recurrent state instead of per-token pages: a cached prefix is usable only up to a
block boundary where the KDA state after exactly that prefix is also cached (a checkpoint). Checkpoints
are taken by the engine, which ends a prefill chunk at each checkpoint boundary of a request:
  - every `interval` tokens (a multiple of the block size; 0 = off),
  - Marconi-style branch points: when a request's prompt shares full blocks with cached ones beyond the
    last checkpoint, the end of that shared run is a boundary whose state is kept — the prefix is being
    hit a second time, so it is worth a state copy; a prefix seen once costs no state;
  - the prompt's last full block, kept only if that prefix hash was seen before (second hit).
Because a branch point is where the shared tokens end, a shared system prompt followed by unique text
never loses its hits to a checkpoint that landed in request-unique tokens.

Eviction: least recently used entries whose block only the cache holds (reference count 1); a block a
running request references is never evicted. A checkpoint goes with the block that ends its prefix.
"""

from __future__ import annotations

import hashlib
from collections import Counter, OrderedDict
from dataclasses import dataclass, field

from .blocks import BlockAllocator

ROOT = b"k31c-prefix-root"


def extend_hashes(hashes: list[bytes], tokens, block_size: int) -> list[bytes]:
    """Append to `hashes` (the chain of tokens' first len(hashes) blocks) the chain hashes of the further
    full blocks of `tokens`; returns the list. A growing request hashes each block once."""
    h = hashes[-1] if hashes else ROOT
    for j in range(len(hashes), len(tokens) // block_size):
        blk = tokens[j * block_size:(j + 1) * block_size]
        h = hashlib.sha256(h + b"|" + ",".join(str(int(t)) for t in blk).encode()).digest()
        hashes.append(h)
    return hashes


def block_hashes(tokens, block_size: int) -> list[bytes]:
    """Chain hashes of the full blocks of `tokens` (the partial last block has none)."""
    return extend_hashes([], tokens, block_size)


@dataclass
class PrefixMatch:
    blocks: list[int]           # cached blocks to share, in order
    tokens: int                 # tokens covered (len(blocks) * block_size)
    state: dict | None          # KDA state after those tokens (None when the model has no KDA layers)
    latent_hit_blocks: int      # full blocks found in the cache (before the KDA checkpoint constraint)


@dataclass
class PrefixStats:
    queries: int = 0
    prompt_blocks: int = 0
    latent_hit_blocks: int = 0     # blocks whose latent pages + index keys were in the cache
    reused_blocks: int = 0         # blocks actually skipped (a KDA checkpoint existed at the boundary)
    kda_state_lookups: int = 0
    kda_state_hits: int = 0
    checkpoints_stored: int = 0
    evicted_blocks: int = 0
    per_kind: dict = field(default_factory=dict)

    def to_json(self) -> dict:
        rate = lambda a, b: round(a / b, 4) if b else 0.0  # noqa: E731
        return {"queries": self.queries, "prompt_blocks": self.prompt_blocks,
                "hit_rate": {"latent_pages": rate(self.latent_hit_blocks, self.prompt_blocks),
                             "index_keys": rate(self.latent_hit_blocks, self.prompt_blocks),
                             "kda_state": rate(self.kda_state_hits, self.kda_state_lookups),
                             "reused_tokens": rate(self.reused_blocks, self.prompt_blocks)},
                "checkpoints_stored": self.checkpoints_stored, "evicted_blocks": self.evicted_blocks}


class PrefixCache:
    def __init__(self, allocator: BlockAllocator, block_size: int, *, has_state: bool, interval: int = 0):
        if interval % block_size:
            raise ValueError(f"KDA checkpoint interval {interval} must be a multiple of the block size {block_size}")
        self.alloc, self.block_size, self.has_state, self.interval = allocator, block_size, has_state, interval
        self.blocks: OrderedDict[bytes, int] = OrderedDict()   # hash -> block, LRU order (oldest first)
        self.states: dict[bytes, dict] = {}                     # hash of a prefix's last block -> KDA state
        self.seen: Counter = Counter()                          # prompt-end hashes seen (Marconi admission)
        self.stats = PrefixStats()

    # ---- lookup --------------------------------------------------------------------------------
    def match(self, tokens) -> PrefixMatch:
        """Longest reusable prefix of `tokens`: whole cached blocks, ending where a KDA state is cached
        (hybrid models), leaving at least one token to compute (its logits start the decode)."""
        hashes = block_hashes(tokens[:max(0, len(tokens) - 1)], self.block_size)
        found = []
        for h in hashes:
            b = self.blocks.get(h)
            if b is None:
                break
            found.append((h, b))
        usable = len(found)
        if self.has_state:
            while usable and found[usable - 1][0] not in self.states:
                usable -= 1
        st = self.stats
        st.queries += 1
        st.prompt_blocks += len(tokens) // self.block_size
        st.latent_hit_blocks += len(found)
        st.reused_blocks += usable
        if self.has_state and found:
            st.kda_state_lookups += 1
            st.kda_state_hits += usable > 0
        for h, _ in found[:usable]:
            self.blocks.move_to_end(h)
        state = self.states[found[usable - 1][0]] if self.has_state and usable else None
        return PrefixMatch([b for _, b in found[:usable]], usable * self.block_size, state, len(found))

    def checkpoint_boundaries(self, tokens, start: int) -> list[int]:
        """Token counts (> start, < len(tokens)) after which the engine should snapshot KDA state."""
        if not self.has_state:
            return []
        bs, n = self.block_size, len(tokens)
        hashes = block_hashes(tokens, bs)
        out = set()
        if self.interval:
            out.update(range(self.interval, n, self.interval))
        shared = 0
        while shared < len(hashes) and hashes[shared] in self.blocks:
            shared += 1
        if shared:
            out.add(shared * bs)                       # branch point: a prefix hit a second time
        last = (n // bs) * bs
        if last and hashes and self.seen[hashes[-1]] >= 1:
            out.add(last)                              # prompt end seen before
        return sorted(b for b in out if start < b <= n)

    # ---- insertion ------------------------------------------------------------------------------
    def insert_blocks(self, hashes: list[bytes], blocks: list[int]):
        """Index a request's full blocks (refreshing those already indexed): `hashes` is the chain of its
        computed tokens (`extend_hashes`), `blocks` the blocks holding them, in order."""
        for h, b in zip(hashes, blocks):
            if h in self.blocks:
                self.blocks.move_to_end(h)
                continue
            self.alloc.share([b])
            self.blocks[h] = b

    def note_prompt(self, tokens):
        hashes = block_hashes(tokens, self.block_size)
        if hashes:
            self.seen[hashes[-1]] += 1

    def store_state(self, hashes: list[bytes], state: dict) -> bool:
        """Keep the KDA state after the prefix whose full-block chain is `hashes` (indexed already; the
        prefix must end on a block boundary)."""
        if not hashes or hashes[-1] not in self.blocks:
            return False
        if hashes[-1] not in self.states:
            self.states[hashes[-1]] = {k: v.clone() for k, v in state.items()}
            self.stats.checkpoints_stored += 1
        return True

    # ---- eviction -------------------------------------------------------------------------------
    def evict(self, want_free: int) -> int:
        """Drop LRU entries held only by the cache until `want_free` blocks are free; returns freed."""
        freed = 0
        for h in list(self.blocks):
            if self.alloc.num_free >= want_free:
                break
            b = self.blocks[h]
            if self.alloc.refs[b] != 1:
                continue  # a running request holds it
            del self.blocks[h]
            self.states.pop(h, None)
            freed += len(self.alloc.release([b]))
        self.stats.evicted_blocks += freed
        return freed

    def clear(self):
        for b in self.blocks.values():
            self.alloc.release([b])
        self.blocks.clear()
        self.states.clear()

    @property
    def held_blocks(self) -> int:
        return len(self.blocks)
