"""configs/external.py's agent, task set and eval on a real checkpoint: configs/qwen3_8b.py's model, cells
and train sections (a config composes others' sections; it copies no field).

Command (a Qwen3 checkpoint directory; nothing is downloaded):
    python -m launch.main --config configs/external_qwen3_8b.py --workdir /tmp/ext_qwen3 \\
        --config.model.hf_path=/ckpt/Qwen3-8B

Expected: not run here (no accelerator); the layout is configs/qwen3_8b.py's (an 8-GPU node, 2 cells of 4),
``--plan=h100-80g:8`` prints its memory plan. tests/test_config_schema.py builds it on a tiny checkpoint.
"""
import os
import runpy

from gyre_jax.rl.config import load_config

_HERE = os.path.dirname(os.path.abspath(__file__))
_CHECKPOINT = runpy.run_path(os.path.join(_HERE, "qwen3_8b.py"))
PLAN_SHAPE = _CHECKPOINT["PLAN_SHAPE"]  # --plan without a checkpoint: Qwen3-8B's published shape
PLANNED_HARDWARE = _CHECKPOINT["PLANNED_HARDWARE"]  # its layouts (tests/test_planner.py checks each fits)


def get_config():
    c = load_config(os.path.join(_HERE, "external.py"))
    checkpoint = load_config(os.path.join(_HERE, "qwen3_8b.py"))
    for section in ("model", "cells", "train"):
        c[section] = checkpoint[section]
    c.harness.max_tokens = checkpoint.harness.max_tokens  # a real model's turns are longer than the byte model's
    return c
