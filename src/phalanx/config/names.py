"""The names users may give a strategy or a precision, and their aliases, held by config itself (it
imports nothing above it); strategies/ and loop/precision.py own the behaviour behind each name."""
from __future__ import annotations

# In the order users read them in error messages; "single" is what a world of one runs.
STRATEGIES: tuple[str, ...] = ("dp", "ddp", "zero1", "zero2", "zero3", "fsdp", "auto", "hsdp", "single")
STRATEGY_ALIASES: dict[str, str] = {"fsdp": "zero3"}

PRECISIONS: tuple[str, ...] = ("no", "bf16", "fp16")
PRECISION_ALIASES: dict[str, str] = {"none": "no", "fp32": "no", "bfloat16": "bf16", "float16": "fp16"}


def canonical_strategy(name: str) -> str:
    """'FSDP ' -> 'zero3'; unknown names come back lower-cased, for the caller to refuse."""
    key = name.strip().lower()
    return STRATEGY_ALIASES.get(key, key)


def canonical_precision(name: str | None) -> str:
    key = (name or "no").strip().lower()
    return PRECISION_ALIASES.get(key, key)
