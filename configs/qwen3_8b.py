"""RL on a Qwen3 checkpoint you already have (job 'rl'): the elastic loop, its proxy speaking
Qwen3's own chat template and ``<tool_call>`` syntax, the repo_spec agent tasks.

Command (the checkpoint is a Hugging Face directory: config.json, model*.safetensors,
tokenizer.json, tokenizer_config.json; nothing is downloaded):

    python -m launch.main --config configs/qwen3_8b.py --workdir /tmp/qwen3 \\
        --config.model.hf_path=/ckpt/Qwen3-8B

Other sizes of the family need no other file (Qwen3-0.6B ... 32B; Qwen2.5 loads too):
the shape comes from the checkpoint's config.json, only the layout below changes.
At the end of the run the policy is written to <workdir>/elastic/hf_export as a HF
checkpoint (the source's dtype and tokenizer files), which vLLM or SGLang serve as is.

Cell layout (parallelism) to pick:

* **8-GPU node (8x H100 80 GB), one process** -- the defaults below: ``cell_size=4`` gives
  2 cells. Training mesh ('fsdp', 'tensor') = (4, 1): Qwen3-8B's f32 master params and
  Adam moments (~128 GB with the gradients) are sharded 4 ways, activations rematerialized
  per layer (``remat``); serving mesh ('data', 'tensor') = (1, 4): weights split over 4 GPUs
  (32 q / 8 kv heads divide by 4), 16 decode slots of up to 32K tokens per engine. Cell 0
  (the core) holds the optimizer state; elastic mode moves cell 1 between serving and
  training as the scheduler decides. Qwen3-32B: ``--config.cells.cell_size=8
  --config.cells.serve_tensor=8`` (one cell: ``--config.scheduler.mode=colocate``).
* **TPU v5p-8 (4 chips, 95 GB HBM each, one host)**: ``--config.cells.cell_size=4
  --config.cells.serve_tensor=4 --config.scheduler.mode=colocate --config.cells.max_slots=8``
  (one cell that serves and trains in turn; it holds the training state and the engine's
  cache at once, so 8 slots of 32K). Larger v5p slices (v5p-16 and up) span several hosts: run one
  process per host (README: SLURM / JobSet lines), each host's 4 chips one cell
  (``cell_size=4``; process 0 is the core, the others satellites that serve or train).
  A cell that spans hosts (``cell_size=8``, a 2x2x2 sub-cube) is refused for now: the
  multi-process loop (gyre_jax/pods/rl_job.py) runs exactly one cell per process.
  Several 8-GPU nodes: ``cell_size=8`` per node the same way.

Memory: ``--plan=h100-80g:8`` prints the plan per device and role (gyre_jax/planner.py). The
engine preallocates ``max_slots x max_len`` of KV cache (144 KiB per token for Qwen3-8B): the
64 slots this config first named were 288 GiB per engine, 72 GiB per GPU after the 4-way split,
which with the 7.6 GiB of f32 weights does not fit 80 GB; 16 slots (18 GiB per GPU) do. Raise
``cells.max_slots`` only with a shorter ``cells.max_len`` (slots x max_len is what counts).

These layouts are what the memory arithmetic above gives; they were not run here (this
machine has no accelerator); expected runtime and reward on a real 8B checkpoint: not
measured. What was run (2 CPU cores, Dec 1 2026): tests/test_hf_rl.py builds this config on a
tiny Qwen3-layout checkpoint, takes one RL step through the real proxy and exports (~15 s);
the same from the command line, with the sizes shrunk by flags
(--config.steps=1 --config.model.max_seq_len=768 --config.cells.max_len=768
--config.cells.serve_tensor=2 --config.train.row_len=768 --config.task.family=tiny ...),
took 19 s and transformers loads and generates from the exported checkpoint.
"""
import ml_collections

from gyre_jax.rl.config import EvalConfig, HarnessKnobs, LoraKnobs, TaskConfig, section, train_objective_fields
from gyre_jax.scheduler.policy import DEFAULT_MIN_WORK_PER_SWITCH_S

# What `python -m launch.main --config configs/qwen3_8b.py --plan=h100-80g:8` plans for when no
# checkpoint is named: Qwen3-8B's published config.json (hf_path, when set, wins).
PLAN_SHAPE = dict(vocab_size=151936, d_model=4096, n_layers=36, n_heads=32, n_kv_heads=8, head_dim=128, d_ff=12288,
                  tie_embeddings=False, qk_norm=True, rope_theta=1e6)
# The layouts above, as (device kind, count, --config overrides); tests/test_planner.py checks each fits.
PLANNED_HARDWARE = (
    ("h100-80g", 8, {}),
    ("tpu-v5p", 4, {"cells.cell_size": 4, "cells.serve_tensor": 4, "scheduler.mode": "colocate", "cells.max_slots": 8}),
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
        # Variables for the checkpoint's chat template in every render, as JSON; e.g. '{"enable_thinking": false}'
        # (Qwen3's non-thinking mode). A request's own chat_template_kwargs go over them.
        chat_template_kwargs="",
        max_seq_len=32768,  # longest context trained/served (<= the checkpoint's max_position_embeddings)
        remat=True,  # recompute each layer in the backward pass: long rows fit
        dtype="bfloat16",  # activations and matmul inputs
        param_dtype="float32",  # master params and Adam moments (the bf16 file upcasts exactly)
    ))
    c.cells = ml_collections.ConfigDict(dict(
        cell_size=4,  # devices per cell: an 8-GPU node -> 2 cells
        train_tensor=1,  # training mesh ('fsdp', 'tensor') = (4, 1)
        train_expert=1,  # expert-parallel degree: 1 (a dense model)
        serve_tensor=4,  # serving mesh ('data', 'tensor') = (1, 4)
        serve_expert=1,  # expert-parallel degree when serving: 1 (a dense model)
        max_slots=16,  # concurrent decode slots per engine (x max_len of KV preallocated: see Memory above)
        max_len=32768,  # KV-cache length per slot
        tokens_per_call=8,
        switch_retries=2,
    ))
    c.scheduler = ml_collections.ConfigDict(dict(
        mode="elastic", groups_per_step=8, group_size=8, staleness_bound=1, updates_per_publication=1,
        async_train_cells=1, min_work_per_switch_s=DEFAULT_MIN_WORK_PER_SWITCH_S, serve_reserve=1.0, poll_s=0.05,
        priors="",  # measured costs as priors: a pilot run's <workdir>/<mode>/scheduler_costs.json ("" = none)
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
        row_len=32768, micro_batch_rows=4,  # a multiple of the fsdp size (4)
        learning_rate=1e-6, warmup_steps=10, weight_decay=0.0, max_grad_norm=1.0, adam_b2=0.999, adam_eps=1e-8,
        work_s_per_row=2.0,
        routing_replay=False,  # MoE models only (configs/qwen3_30b_a3b.py turns it on)
        lora=section(LoraKnobs),  # LoRA instead of full fine-tuning: --config.train.lora.rank=16 (rank 0 = off)
        # The objective (loss, advantage, weights, mismatch and their options; configs/demo.py comments
        # each): gyre_jax.rl.config.TrainConfig's defaults, clipped-ratio GRPO with DAPO's clip-higher.
        **train_objective_fields(),
    ))
    c.sft = ml_collections.ConfigDict(dict(steps=0, rows=6, learning_rate=1e-5, demos=64, noisy_fraction=0.0,
                                           noisy_kind="reverse"))  # a real checkpoint needs no warm start
    c.eval = ml_collections.ConfigDict(section(EvalConfig, every=20, kind="episodes", tasks=32,
                                                    samples_per_task=4))  # whole episodes
    c.faults = ml_collections.ConfigDict(dict(
        grader_crash_every=0, timeout_every=0, engine_error_every=0, pause_at_step=0, switch_delay_s=0.0,
        switch_fail_every=0, satellite_fail_every=0, chaos_seed=0, core_fail_at_step=0,
    ))
    return c
