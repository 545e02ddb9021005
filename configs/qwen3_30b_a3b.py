"""RL on Qwen3-30B-A3B (mixture of experts: 128 experts, 8 per token, ~3.3B active of ~30.5B)
from a checkpoint you already have (job 'rl'); everything else as configs/qwen3_8b.py.

Command (a Hugging Face directory with config.json, model*.safetensors and the tokenizer files;
nothing is downloaded):

    python -m launch.main --config configs/qwen3_30b_a3b.py --workdir /tmp/a3b \\
        --config.model.hf_path=/ckpt/Qwen3-30B-A3B

The checkpoint loads as ``Qwen3MoeForCausalLM`` (gyre_jax/model/hf: the 128 x 48 x 3 per-expert
tensors are streamed into stacked [layer, expert, ...] params) and exports back to the same
layout at the end of the run. The train loss adds ``router_aux_loss_coef`` x the
load-balancing loss only when the checkpoint's config.json says ``output_router_logits``
(as transformers does); the step reports ``moe_aux_loss`` and ``moe_max_load``.

Routing replay is on (``train.routing_replay``): the engines record the 8 experts each of the
48 MoE layers chose for every sampled token (384 bytes per generated token in the call
records), and the training forward routes those tokens to the recorded experts (the live
router still weights them and gets the gradient). The step reports ``routing_mismatch``, the
fraction of trained tokens whose live routing differs from the recorded one.

Cell layout (parallelism) to pick; ``--plan=KIND:N`` prints the memory plan per device:

* **8-GPU node (8x H100 80 GB), one process**: the defaults below, one cell of 8 that serves
  and trains in turn (``scheduler.mode=colocate``). Training mesh ('fsdp', 'tensor') = (8, 1):
  bf16 params, Adam moments and gradients (~305 GB for 30.5B params) sharded 8 ways, 35.5 GiB
  per GPU, remat per layer; serving mesh ('data', 'tensor') = (2, 4): 4 KV heads split over
  4 GPUs (96 KiB of KV per token in bf16), 16 slots of 16K tokens (3 GiB per GPU), the
  engine's weights 14.2 GiB per GPU; the plan: 60.9 of 80 GiB used per GPU. f32 master params
  (610 GB) do not fit one node: use two nodes (cell_size=8 each, the second a satellite).
  With expert parallelism (``--config.cells.train_expert=2``: training mesh fsdp=4 x
  expert=2 x tensor=1) the 128 experts also split over an 'expert' mesh axis and tokens go
  to them all-to-all (exact, but the dispatch buffers are sized for the worst case, so the
  plan above does not cover them; see docs/design.md). Serving keeps every expert per cell unless
  ``--config.cells.serve_expert=2`` (serving mesh data=1 x expert=2 x tensor=4): each GPU then
  holds half of the experts (the engine's weights 7.5 instead of 14.2 GiB per GPU; the plan:
  54.1 of 80 GiB), and decode and prefill send tokens to them all-to-all.
* **TPU v5p-16 (8 chips, 95 GB HBM each)**: the same one-cell layout,
  ``--config.cells.cell_size=8`` (a 2x2x2 slice spans two hosts: one process per host is not
  yet supported for a cell, so this layout needs the single-controller run; the plan below
  is checked with ``tpu-v5p:8``).

These layouts are the memory arithmetic of gyre_jax/planner.py (tests/test_planner.py checks
each fits); they were not run (no accelerator here). What was run: tests/test_hf_moe.py
(a tiny Qwen3-MoE checkpoint in, out, logits against a float64 reference) and
tests/test_moe*.py (the MoE block, decode, expert parallelism over 2 and 4 CPU devices).
Expected runtime and reward on the real checkpoint: not measured.
"""
import os

from gyre_jax.rl.config import load_config

_QWEN3_8B = os.path.join(os.path.dirname(os.path.abspath(__file__)), "qwen3_8b.py")

# What `python -m launch.main --config configs/qwen3_30b_a3b.py --plan=h100-80g:8` plans for when no
# checkpoint is named: Qwen3-30B-A3B's published config.json (hf_path, when set, wins).
PLAN_SHAPE = dict(vocab_size=151936, d_model=2048, n_layers=48, n_heads=32, n_kv_heads=4, head_dim=128, d_ff=6144,
                  tie_embeddings=False, qk_norm=True, rope_theta=1e6, num_experts=128, num_experts_per_tok=8,
                  moe_intermediate_size=768, norm_topk_prob=True)
# The layouts above, as (device kind, count, --config overrides); tests/test_planner.py checks each fits.
PLANNED_HARDWARE = (
    ("h100-80g", 8, {}),
    ("tpu-v5p", 8, {}),
)


def get_config():
    c = load_config(_QWEN3_8B)
    c.model.max_seq_len = 16384  # longest context trained/served (<= the checkpoint's max_position_embeddings)
    c.model.param_dtype = "bfloat16"  # params and Adam moments in bf16: f32 (610 GB with moments) needs two nodes
    c.cells.cell_size = 8  # an 8-GPU node -> 1 cell (colocate); training mesh ('fsdp', 'tensor') = (8, 1)
    c.cells.train_expert = 1  # 2 splits the experts over an 'expert' mesh axis (fsdp=4 x expert=2)
    c.cells.serve_tensor = 4  # serving mesh ('data', 'tensor') = (2, 4): 4 KV heads, one per tensor shard
    c.cells.max_len = 16384  # KV-cache length per slot (16 slots)
    c.scheduler.mode = "colocate"  # one cell serves and trains in turn
    c.train.row_len, c.train.micro_batch_rows = 16384, 8  # a multiple of the fsdp size (8)
    # R3: a token routed to other experts in training than when it was sampled (bf16 engine vs trainer
    # numerics, and stale policies) makes its importance ratio meaningless; replay the sampled routing.
    c.train.routing_replay = True
    return c
