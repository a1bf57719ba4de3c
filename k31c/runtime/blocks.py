"""Reference-counted cache blocks: the allocator behind paged caches and prefix sharing.

A block is `block_size` consecutive pool rows. A request holds a list of blocks (its block table); a
block shared by several requests (a cached prefix) is counted once per holder, and the prefix cache
holds its own reference. A block returns to the free list when its count drops to zero.

    alloc = BlockAllocator(num_blocks=64)
    blocks = alloc.allocate(3)        # three fresh blocks, count 1 each
    alloc.share(blocks[:2])           # a second holder of the first two
    alloc.release(blocks)             # counts drop; the third block is free again
"""

from __future__ import annotations


class BlocksExhausted(RuntimeError):
    """Not enough free blocks; nothing was allocated."""

    def __init__(self, needed: int, free: int, total: int):
        super().__init__(f"needs {needed} free cache blocks, {free} of {total} are free")
        self.needed, self.free, self.total = needed, free, total


class BlockAllocator:
    def __init__(self, num_blocks: int):
        if num_blocks < 1:
            raise ValueError(f"a block allocator needs at least one block, got {num_blocks}")
        self.num_blocks = num_blocks
        self._free = list(range(num_blocks - 1, -1, -1))  # a stack: lowest block handed out first
        self.refs = [0] * num_blocks

    @property
    def num_free(self) -> int:
        return len(self._free)

    def allocate(self, n: int) -> list[int]:
        if n < 0:
            raise ValueError(f"cannot allocate {n} blocks")
        if n > len(self._free):
            raise BlocksExhausted(n, len(self._free), self.num_blocks)
        out = [self._free.pop() for _ in range(n)]
        for b in out:
            self.refs[b] = 1
        return out

    def share(self, blocks) -> None:
        for b in blocks:
            if self.refs[b] <= 0:
                raise ValueError(f"block {b} is free; only held blocks can be shared")
            self.refs[b] += 1

    def release(self, blocks) -> list[int]:
        """Drop one reference of each block; returns the blocks that became free."""
        freed = []
        for b in blocks:
            if self.refs[b] <= 0:
                raise ValueError(f"block {b} released more often than it was held")
            self.refs[b] -= 1
            if self.refs[b] == 0:
                freed.append(b)
        self._free.extend(sorted(freed, reverse=True))
        return freed

    def check(self) -> list[str]:
        """Consistency problems (a block both free and held, or listed twice): empty when sound."""
        problems = []
        free = set(self._free)
        if len(free) != len(self._free):
            problems.append("a block is on the free list twice")
        for b in range(self.num_blocks):
            if (b in free) == (self.refs[b] > 0):
                problems.append(f"block {b}: refs {self.refs[b]}, on free list {b in free}")
        return problems
