"""Shared pieces of the command line: usage errors, token-list parsing and checks, messages."""

from __future__ import annotations

import os
import sys


class UsageError(ValueError):
    """Bad command-line input; all problems found are listed together."""

    def __init__(self, problems: list[str]):
        self.problems = problems
        super().__init__("\n".join(f"  - {p}" for p in problems) if len(problems) > 1 else problems[0])


def parse_token_list(text: str, what: str, problems: list[str]) -> list[int]:
    parts = [t.strip() for t in text.split(",") if t.strip()]
    if not parts:
        problems.append(f"{what} is empty; give comma-separated token ids, e.g. {what} 1,2,3")
        return []
    out = []
    for t in parts:
        try:
            out.append(int(t))
        except ValueError:
            problems.append(f"{what}: {t!r} is not an integer token id")
    return out


def check_tokens(tokens: list[int], vocab: int, what: str, problems: list[str]):
    bad = [t for t in tokens if not 0 <= t < vocab]
    if bad:
        problems.append(f"{what}: token ids {bad[:8]} outside the model's vocabulary [0, {vocab})")


def check_out_path(path: str, problems: list[str]):
    folder = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(folder):
        problems.append(f"--out {path}: folder {folder} does not exist (create it first: mkdir -p {folder})")


def _torch_dtype(name: str):
    import torch

    return {"fp32": torch.float32, "fp64": torch.float64, "bf16": torch.bfloat16}[name]


def _say(msg: str):
    print(msg, file=sys.stderr)
