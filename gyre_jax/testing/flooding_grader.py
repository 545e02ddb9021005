"""A fake grader for tests: prints tens of MiB and returns oversized, deeply nested details.

It stands for a grader that echoes what agent code printed or copies files into its
details; the trainer must keep only bounded heads and tails of all of it.
"""
from __future__ import annotations

import os
from pathlib import Path

from gyre_jax.agents.scoring import Grade

FLOOD_BYTES = 50 << 20


def flooding_grader(task, workspace: Path) -> Grade:
    chunk = b"o" * (1 << 20)
    for _ in range(FLOOD_BYTES >> 20):
        os.write(1, chunk)
        os.write(2, chunk)
    os.write(1, b"\n")
    deep: dict = {}
    node = deep
    for _ in range(200):
        node["d"] = {}
        node = node["d"]
    return Grade(0.5, {"log": "START" + "x" * FLOOD_BYTES + "END", "deep": deep, "many": list(range(10000))})
