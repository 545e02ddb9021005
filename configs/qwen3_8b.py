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
from gyre_jax.rl.config import checkpoint_model, rl_config

# What `python -m launch.main --config configs/qwen3_8b.py --plan=h100-80g:8` plans for when no
# checkpoint is named: Qwen3-8B's published config.json (hf_path, when set, wins).
PLAN_SHAPE = dict(vocab_size=151936, d_model=4096, n_layers=36, n_heads=32, n_kv_heads=8, head_dim=128, d_ff=12288,
                  tie_embeddings=False, qk_norm=True, rope_theta=1e6)
# The layouts above, as (device kind, count, --config overrides); tests/test_planner.py checks each fits.
PLANNED_HARDWARE = (
    ("h100-80g", 8, {}),
    ("tpu-v5p", 4, {"cells.cell_size": 4, "cells.serve_tensor": 4, "scheduler.mode": "colocate", "cells.max_slots": 8}),
)


def get_config():
    c = rl_config()  # the RL job's defaults; what differs for an 8B checkpoint on an 8-GPU node:
    c.steps = 200  # RL optimizer steps
    c.checkpoint_every = 20  # Orbax checkpoint (params + Adam state + data position) every k steps
    checkpoint_model(c)  # REQUIRED: --config.model.hf_path=/ckpt/Qwen3-8B (the shape is its config.json's)
    c.model.hf_export = True  # save_pretrained the policy into <workdir>/<mode>/hf_export after the last step
    # model.chat_template_kwargs: e.g. '{"enable_thinking": false}' (Qwen3's non-thinking mode), as JSON.
    c.model.max_seq_len = 32768  # longest context trained/served (<= the checkpoint's max_position_embeddings)
    c.model.remat = True  # recompute each layer in the backward pass: long rows fit
    c.model.dtype = "bfloat16"  # activations and matmul inputs (params and Adam moments stay float32)
    c.cells.cell_size = 4  # devices per cell: an 8-GPU node -> 2 cells; training mesh ('fsdp', 'tensor') = (4, 1)
    c.cells.serve_tensor = 4  # serving mesh ('data', 'tensor') = (1, 4)
    c.cells.max_len = 32768  # KV-cache length per slot (16 slots: see Memory above)
    c.task.family = "repo_spec"  # or task.dataset=<your tasks.jsonl>
    h = c.harness  # kind=builtin here; kind=command / python bring your own agent (configs/external.py)
    h.max_tokens = 2048  # per model call
    h.max_turns = 30  # model calls per agent
    h.deadline_s = 1800.0
    h.request_timeout_s = 600.0
    h.backoff_base_s = 0.5
    h.grader_timeout_s = 120.0
    h.system_prompt = ""  # the task's own
    h.send_tools_schema = True  # tools in the template's tools section; calls in the model's <tool_call> syntax
    c.train.row_len = 32768
    c.train.micro_batch_rows = 4  # a multiple of the fsdp size (4)
    c.train.learning_rate = 1e-6
    c.train.warmup_steps = 10
    c.train.work_s_per_row = 2.0
    c.sft.steps = 0  # a real checkpoint needs no warm start
    c.sft.learning_rate = 1e-5
    c.sft.demos = 64
    c.eval.every = 20
    c.eval.kind = "episodes"  # whole episodes
    c.eval.samples_per_task = 4
    return c
