"""Byte-level tokenizer for the built-in presets: token id = UTF-8 byte (0..255)."""

from __future__ import annotations


class ByteTokenizer:
    def __init__(self, vocab_size: int):
        if vocab_size < 256:
            raise ValueError(f"the byte tokenizer needs vocab_size >= 256, model has {vocab_size}")
        self.vocab_size = vocab_size

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: list[int]) -> str:
        out, pending = [], bytearray()
        for i in ids:
            if i < 256:
                pending.append(i)
                continue
            out.append(pending.decode("utf-8", errors="replace"))
            pending = bytearray()
            out.append(f"<{i}>")  # ids beyond bytes have no text in this tokenizer
        out.append(pending.decode("utf-8", errors="replace"))
        return "".join(out)
