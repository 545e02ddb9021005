"""RL on a Llama-3.x Instruct checkpoint (job 'rl'): configs/qwen3_8b.py with Llama's needs.

Command:

    python -m launch.main --config configs/llama3_8b.py --workdir /tmp/llama3 \\
        --config.model.hf_path=/ckpt/Llama-3.1-8B-Instruct

The proxy speaks the checkpoint's own template (Llama-3.1: tools in the first user
message, JSON tool calls ``{"name": ..., "parameters": {...}}`` as the whole assistant
message, tool results as ``ipython`` turns, ``<|eot_id|>`` ends a turn); ``llama3`` rope
scaling and the untied lm_head come from its config.json.

Cell layout: as configs/qwen3_8b.py. 8-GPU node: 2 cells of 4 GPUs, training
('fsdp', 'tensor') = (4, 1), serving ('data', 'tensor') = (1, 4) (32 q / 8 kv heads);
the untied 128256 x 4096 lm_head adds ~2 GB (f32) to the training state.
TPU v5p-8: one cell of 4 chips, ``--config.scheduler.mode=colocate --config.cells.max_slots=8``
(its flags in configs/qwen3_8b.py; ``--plan=tpu-v5p:4`` checks it); larger slices need
the multi-process loop. Not run on real hardware here; on CPU a tiny Llama-layout
checkpoint builds, loads and takes a step (tests/test_hf_rl.py).
Llama-3.1 calls one tool per message: the template raises on several, and the proxy
answers such a request with a 400 naming it.
"""
import os
import runpy

from gyre_jax.rl.config import load_config

_QWEN3_8B = os.path.join(os.path.dirname(os.path.abspath(__file__)), "qwen3_8b.py")

# Llama-3.1-8B's published config.json, for --plan without a checkpoint (configs/qwen3_8b.py).
PLAN_SHAPE = dict(vocab_size=128256, d_model=4096, n_layers=32, n_heads=32, n_kv_heads=8, head_dim=128, d_ff=14336,
                  tie_embeddings=False, rope_theta=5e5)
PLANNED_HARDWARE = runpy.run_path(_QWEN3_8B)["PLANNED_HARDWARE"]


def get_config():
    c = load_config(_QWEN3_8B)
    c.model.max_seq_len = 32768  # Llama-3.1 supports 128K with its rope scaling; 32K fits the layout above
    c.harness.max_tokens = 1024  # Llama-3.1 writes shorter turns (no thinking block)
    return c
