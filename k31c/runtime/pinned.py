"""Two pinned host buffers used in turn for asynchronous host<->device copies (the runtime's step metadata,
the engine's sampling parameters and sampled ids), so the host fills one while the copy out of (or into)
the other may still be pending; a buffer is handed out again only after the copy that last used it has run.

    pair = PinnedPair(1024, torch.int32, device)
    buf = pair.take(n)                  # waits (rarely) for this buffer's previous copy
    dev.copy_(buf, non_blocking=True)   # or buf.copy_(dev_tensor, non_blocking=True)
    done = pair.copied()                # event after that copy; the next take() uses the other buffer

Off the GPU the buffers are plain tensors and nothing is recorded.
"""

from __future__ import annotations

import torch


class PinnedPair:
    def __init__(self, size: int, dtype: torch.dtype, device):
        self.cuda = torch.device(device).type == "cuda"
        self.bufs = [torch.empty(int(size), dtype=dtype, pin_memory=self.cuda) for _ in range(2 if self.cuda else 1)]
        self._events: list = [None] * len(self.bufs)
        self._next = 0

    def take(self, n: int) -> torch.Tensor:
        """The first n elements of the next buffer, once its last copy has run."""
        buf = self.bufs[self._next]
        if n > buf.numel():
            raise ValueError(f"pinned buffer of {buf.numel()} elements asked for {n}")
        if self._events[self._next] is not None:
            self._events[self._next].synchronize()
        return buf[:n]

    def copied(self):
        """Record that the buffer just taken is in a copy enqueued on the current stream; turn to the other.
        Returns the event (None off the GPU)."""
        ev = None
        if self.cuda:
            ev = torch.cuda.Event()
            ev.record()
        self._events[self._next] = ev
        self._next = (self._next + 1) % len(self.bufs)
        return ev
