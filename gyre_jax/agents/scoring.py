"""Partial-credit building blocks shared by the graders (pure, no I/O)."""
from __future__ import annotations

import dataclasses
import math
from typing import Any

# The line a grader subprocess prints its verdict on (grader_main writes it, graders reads it).
RESULT_PREFIX = "GYRE-GRADE "


@dataclasses.dataclass(frozen=True)
class Grade:
    """A grader's verdict: ``score`` in [0, 1] and JSON ``details`` explaining it."""
    score: float
    details: dict[str, Any] = dataclasses.field(default_factory=dict)

    def __post_init__(self):
        if not isinstance(self.score, (int, float)) or isinstance(self.score, bool) or not math.isfinite(self.score) \
                or not 0.0 <= self.score <= 1.0:
            raise ValueError(f"Grade.score must be a finite number in [0, 1], got {self.score!r}")


class Checks:
    """Named pass/fail checks; score = fraction passed (each check weighs the same)."""

    def __init__(self):
        self.items: list[dict[str, Any]] = []

    def add(self, name: str, ok: bool, note: str = "") -> bool:
        if any(c["check"] == name for c in self.items):
            raise ValueError(f"duplicate check name {name!r}")
        self.items.append({"check": name, "ok": bool(ok), "note": note})
        return bool(ok)

    @property
    def passed(self) -> int:
        return sum(c["ok"] for c in self.items)

    def grade(self, **extra: Any) -> Grade:
        total = len(self.items)
        if total == 0:
            raise ValueError("a grade needs at least one check")
        return Grade(self.passed / total, {"passed": self.passed, "total": total, "checks": self.items, **extra})


def char_match_score(expected: str, got: str) -> float:
    """Characters equal at the same position over the longer length: "cba" vs "cbx"
    -> 2/3, "cba" vs "cbaa" -> 3/4, "" vs "" -> 1."""
    n = max(len(expected), len(got))
    if n == 0:
        return 1.0
    return sum(a == b for a, b in zip(expected, got)) / n
