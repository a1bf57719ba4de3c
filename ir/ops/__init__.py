"""Importing this package registers every op (see registry.py for how an op is declared)."""

from . import attention, basic, collective, kda, moe  # noqa: F401  (registration side effects)
from .registry import OPS, Attr, OpDef, attr, defop, get_op, register

__all__ = ["OPS", "Attr", "OpDef", "attr", "defop", "get_op", "register"]
