"""Triton kernel families, one per file. Without a GPU the kernels run in Triton's interpreter,
which must be chosen before any kernel is decorated: importing this package does that."""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
