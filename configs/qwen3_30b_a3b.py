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
  plan above does not cover them; see docs/design.md). Serving keeps every expert per cell.
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
import ml_collections

from gyre_jax.rl.config import EvalConfig, HarnessKnobs, TaskConfig, section, train_objective_fields
from gyre_jax.scheduler.policy import DEFAULT_MIN_WORK_PER_SWITCH_S

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


def get_config() -> ml_collections.ConfigDict:
    c = ml_collections.ConfigDict()
    c.job = "rl"
    c.seed = 0
    c.steps = 200  # RL optimizer steps
    c.num_cpu_devices = 8  # only used on CPU
    c.recoverable_processes = True  # pods (one process per cell): a satellite process may die alone
    c.first_last = 10
    c.checkpoint_every = 20  # Orbax checkpoint (params + Adam state + data position) every k steps
    c.progress = True
    c.progress_every_s = 60.0
    c.model = ml_collections.ConfigDict(dict(
        hf_path="",  # REQUIRED: a HF checkpoint directory (--config.model.hf_path=/ckpt/Qwen3-8B)
        hf_export=True,  # save_pretrained the policy into <workdir>/<mode>/hf_export after the last step
        max_seq_len=16384,  # longest context trained/served (<= the checkpoint's max_position_embeddings)
        remat=True,  # recompute each layer in the backward pass: long rows fit
        dtype="bfloat16",  # activations and matmul inputs
        param_dtype="bfloat16",  # params and Adam moments in bf16: f32 (610 GB with moments) needs two nodes
    ))
    c.cells = ml_collections.ConfigDict(dict(
        cell_size=8,  # devices per cell: an 8-GPU node -> 1 cell (colocate)
        train_tensor=1,  # training mesh ('fsdp', 'tensor') = (8, 1)
        train_expert=1,  # 2 splits the experts over an 'expert' mesh axis (fsdp=4 x expert=2)
        serve_tensor=4,  # serving mesh ('data', 'tensor') = (2, 4): 4 KV heads, one per tensor shard
        max_slots=16,  # concurrent decode slots per engine (x max_len of KV preallocated)
        max_len=16384,  # KV-cache length per slot
        tokens_per_call=8,
        switch_retries=2,
    ))
    c.scheduler = ml_collections.ConfigDict(dict(
        mode="colocate", groups_per_step=8, group_size=8, staleness_bound=1, updates_per_publication=1,
        async_train_cells=1, min_work_per_switch_s=DEFAULT_MIN_WORK_PER_SWITCH_S, serve_reserve=1.0, poll_s=0.05,
    ))
    c.task = ml_collections.ConfigDict(section(TaskConfig, family="repo_spec"))  # or dataset=<your tasks.jsonl>
    c.harness = ml_collections.ConfigDict(section(
        HarnessKnobs,  # kind=builtin here; kind=command / python bring your own agent (configs/external.py)
        sandbox="auto",  # where tool commands run: auto (bubblewrap where it works) | bubblewrap | docker | podman | none
        max_tokens=2048,  # per model call
        temperature=1.0,
        max_turns=30,  # model calls per agent
        deadline_s=1800.0,
        request_timeout_s=600.0,
        max_retries=2,
        backoff_base_s=0.5,
        grader_timeout_s=120.0,
        system_prompt="",  # "" = the task's own
        send_tools_schema=True,  # tools in the template's tools section; calls in the model's <tool_call> syntax
    ))
    c.train = ml_collections.ConfigDict(dict(
        row_len=16384, micro_batch_rows=8,  # a multiple of the fsdp size (8)
        learning_rate=1e-6, warmup_steps=10, weight_decay=0.0, max_grad_norm=1.0, adam_b2=0.999, adam_eps=1e-8,
        work_s_per_row=2.0,
        # The objective (loss, advantage, weights, mismatch and their options; configs/demo.py comments
        # each): gyre_jax.rl.config.TrainConfig's defaults, clipped-ratio GRPO with DAPO's clip-higher.
        **train_objective_fields(),
    ))
    c.sft = ml_collections.ConfigDict(dict(steps=0, rows=6, learning_rate=1e-5, demos=64, noisy_fraction=0.0,
                                           noisy_kind="reverse"))  # a real checkpoint needs no warm start
    c.eval = ml_collections.ConfigDict(section(EvalConfig, every=20, tasks=32, samples_per_task=4))  # whole episodes
    c.faults = ml_collections.ConfigDict(dict(
        grader_crash_every=0, timeout_every=0, engine_error_every=0, pause_at_step=0, switch_delay_s=0.0,
        switch_fail_every=0, satellite_fail_every=0, chaos_seed=0, core_fail_at_step=0,
    ))
    return c
