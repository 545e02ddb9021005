"""Held-out evaluation of a policy's params: fixed tasks, fixed sampling key, no server.

``HeldOutEval(model_cfg, tasks, tok, ...)(params) -> {"eval_reward", "eval_exact", "eval_format"}``

Why: the RL loop's per-step training reward averages a few different tasks per step,
so it swings from step to step. Here every call samples the SAME tasks with the SAME
PRNG key, so two versions' numbers differ only by their params (at temperature 0 the
outputs are the argmax ones).

What it measures: the FIRST model call of each task only. The prompt is the one the
proxy renders for the harness's first call (system + user messages through
``serving.api_openai.parse_chat``); the sampled reply is cut at ``<|im_end|>``, its
plain-text tool calls (``tools.parse_text_tool_calls``) run in a fresh workspace
(execution stops at the first unparsable, disallowed or failing call, or at ``finish``),
and the family's grader scores the workspace (``graders.grade_in_process``). That is
the whole rollout for one-turn families such as 'tiny' (harness.max_turns=1); for
multi-turn families it is a lower bound (no tool results, no second call), which
needs the real harness.

Device side: one jitted sampler, ``_sample(params, prompts_SxT, lengths_S)``: prefill of
every (padded) prompt under vmap, its k/v written into an ``init_cache`` cache, then a
``lax.scan`` of ``decode_step`` for ``max_tokens`` tokens. Host side: detokenize, run
tools, grade (numpy, temp dirs).
"""
from __future__ import annotations

import asyncio
import tempfile
from pathlib import Path
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from gyre_jax.agents import tools
from gyre_jax.agents.graders import grade_in_process, snapshot_workspace
from gyre_jax.agents.harness import prepare_workspace
from gyre_jax.agents.sandbox import SandboxConfig, make_sandbox
from gyre_jax.agents.tasks.base import Task
from gyre_jax.model import ModelConfig
from gyre_jax.model.decode import decode_step, init_cache, prefill
from gyre_jax.model.unrolled import split_params
from gyre_jax.serving.tokenizer import Tokenizer


def first_call_prompt(task: Task, tok: Tokenizer, system_prompt: str | None) -> list[int]:
    """Prompt ids of a task's first model call, as the proxy renders the harness's request."""
    from gyre_jax.agents.agent import DEFAULT_SYSTEM_PROMPT
    from gyre_jax.serving.api_openai import parse_chat

    system = system_prompt or task.system_prompt or DEFAULT_SYSTEM_PROMPT  # the harness's rule
    body = {"model": "gyre", "max_tokens": 1, "messages": [{"role": "system", "content": system},
                                                            {"role": "user", "content": task.prompt}]}
    return list(parse_chat(body, tok).prompt_ids)


def make_sampler(config: ModelConfig, *, max_tokens: int, max_len: int, temperature: float):
    """Jitted ``sample(params, prompts_SxT, lengths_S, key) -> (tokens_SxN, logp_SxN)``.

    Row s's prompt is ``prompts_SxT[s, :lengths_S[s]]`` (the rest is padding). Tokens are
    drawn from softmax(logits / temperature) (argmax at temperature 0) with one key per
    position split from ``key``; ``logp`` is the sampled token's log-probability under
    that distribution (under softmax(logits) at temperature 0). Generation does not
    stop at ``<|im_end|>`` (static shapes); the caller cuts.
    """

    def sample(params, prompts_SxT, lengths_S, key):
        s, t = prompts_SxT.shape
        logits_SxV, kv = jax.vmap(lambda p, n: prefill(params, config, p, true_length=n))(prompts_SxT, lengths_S)
        cache = init_cache(config, s, max_len)
        # kv.k: [S, Y, T, K, H] -> each layer's cache [S, M, K, H]; entries past a row's length are
        # masked by decode_step and overwritten by its generated tokens.
        cache = cache.replace(k=tuple(c.at[:, :t].set(kv.k[:, i].astype(c.dtype)) for i, c in enumerate(cache.k)),
                              v=tuple(c.at[:, :t].set(kv.v[:, i].astype(c.dtype)) for i, c in enumerate(cache.v)),
                              lengths=lengths_S.astype(jnp.int32))
        layer_params = split_params(config, params)  # once per call, not per token (model/unrolled.py)

        def body(carry, key_t):
            logits_SxV, cache = carry
            logits_SxV = logits_SxV.astype(jnp.float32)
            if temperature == 0:
                tok_S = jnp.argmax(logits_SxV, -1).astype(jnp.int32)
                logp_SxV = jax.nn.log_softmax(logits_SxV)
            else:
                logp_SxV = jax.nn.log_softmax(logits_SxV / temperature)
                tok_S = jax.random.categorical(key_t, logp_SxV).astype(jnp.int32)
            logp_S = jnp.take_along_axis(logp_SxV, tok_S[:, None], 1)[:, 0]
            logits_SxV, cache = decode_step(layer_params, config, tok_S, cache)
            return (logits_SxV, cache), (tok_S, logp_S)

        _, (tok_NxS, logp_NxS) = jax.lax.scan(body, (logits_SxV, cache), jax.random.split(key, max_tokens))
        return tok_NxS.T, logp_NxS.T

    return jax.jit(sample)


def padded_rows(prompts: Sequence[Sequence[int]], repeat: int) -> tuple[np.ndarray, np.ndarray]:
    """(prompts_SxT zero-padded, lengths_S) with each prompt repeated ``repeat`` times in a row
    (task-major: row i holds prompt i // repeat), the sampler's input layout."""
    rows = [p for p in prompts for _ in range(repeat)]
    prompts_SxT = np.zeros((len(rows), max(len(p) for p in rows)), np.int32)
    for i, p in enumerate(rows):
        prompts_SxT[i, :len(p)] = p
    return prompts_SxT, np.asarray([len(p) for p in rows], np.int32)


def cut_at_stop(ids: Sequence[int], stop_ids: Sequence[int]) -> list[int]:
    """The reply as the engine returns it: up to (excluding) the first stop id."""
    out = []
    for t in ids:
        if int(t) in stop_ids:
            break
        out.append(int(t))
    return out


def score_text(task: Task, text: str, sandbox: SandboxConfig | None = None) -> tuple[float | None, bool]:
    """(grader score or None if the grader failed, whether >= 1 tool call parsed) of one reply.

    The reply's plain-text tool calls run in a fresh workspace holding the task's setup
    files, in order, confined by ``sandbox`` exactly as the harness confines a rollout's
    commands (model output never runs on the host unsandboxed; default: ``auto``);
    execution stops at ``finish`` (the harness ends the agent there), at a call that did
    not parse, at a tool the task does not offer, or at a tool error.
    """
    calls = tools.parse_text_tool_calls(text)
    parsed = any(c.error is None for c in calls)
    sandbox = sandbox or SandboxConfig()
    with tempfile.TemporaryDirectory(prefix="gyre-eval-") as root:
        d = Path(root) / "workspace"
        box = make_sandbox(sandbox, d, family=task.family, name=f"eval-{task.task_id}",
                           commands="run" in task.tools)
        prepare_workspace(root, "workspace", task, box)
        try:
            ws = tools.Workspace(d, sandbox=box)

            async def run_calls():
                for c in calls:
                    if c.error is not None or c.name == "finish" or c.name not in task.tools:
                        return
                    try:
                        await ws.call(c.name, c.arguments)
                    except tools.ToolError:
                        return

            if calls:
                asyncio.run(run_calls())
            # As in the harness: the grader reads a copy of the workspace's regular files only.
            snap = Path(root) / "snapshot"
            snapshot_workspace(d, snap, max_bytes=sandbox.limits.disk_bytes, max_entries=sandbox.limits.max_files)
        finally:
            box.release()
        try:
            score = float(grade_in_process(task, snap).score)
        except Exception:  # noqa: BLE001 - a verifier failure is not a score (as in the harness)
            score = None
    return score, parsed


def summarize(scores: Sequence[float | None], parsed: Sequence[bool]) -> dict:
    """eval_reward (mean score), eval_exact (share == 1.0), eval_format (share with >= 1 parsed
    tool call) over the samples; samples whose grader failed count only in eval_grader_errors."""
    ok = np.asarray([s for s in scores if s is not None], np.float64)
    return {"eval_reward": float(ok.mean()) if ok.size else float("nan"),
            "eval_exact": float((ok == 1.0).mean()) if ok.size else float("nan"),
            "eval_format": float(np.mean(parsed)) if len(parsed) else float("nan"),
            "eval_grader_errors": int(sum(s is None for s in scores))}


class HeldOutEval:
    """Fixed tasks x ``samples_per_task`` samples of the first model call, scored by the grader.

    ``max_len`` is the sampler's cache length per row: it must hold the longest prompt plus
    ``max_tokens`` (ValueError otherwise). ``seed`` fixes the sampling key for every call.
    Params may live on any devices (e.g. the core cell's training mesh): they are copied to
    one device first, so the eval never shares a sharded computation with the trainer.
    """

    def __init__(self, model_cfg: ModelConfig, tasks: Sequence[Task], tokenizer: Tokenizer, *,
                 system_prompt: str | None, samples_per_task: int, max_tokens: int, temperature: float, seed: int,
                 max_len: int, device=None, sandbox: SandboxConfig | None = None, prepare=None):
        """``prepare(params) -> params``: what the sampler runs, from what the loop holds (a LoRA run's
        adapters, merged into its base: rl/lora_run.py); None: the params as given."""
        if not tasks:
            raise ValueError("HeldOutEval: tasks must not be empty")
        if samples_per_task <= 0 or max_tokens <= 0 or temperature < 0:
            raise ValueError(f"HeldOutEval: need samples_per_task > 0, max_tokens > 0, temperature >= 0; got "
                             f"{samples_per_task}, {max_tokens}, {temperature}")
        self.tasks, self.tok, self.k = list(tasks), tokenizer, samples_per_task
        self.sandbox, self.prepare = sandbox, prepare
        prompts = [first_call_prompt(t, tokenizer, system_prompt) for t in self.tasks]
        t_max = max(len(p) for p in prompts)
        if t_max + max_tokens > max_len:
            raise ValueError(f"HeldOutEval: max_len={max_len} cannot hold the longest prompt ({t_max} tokens) + "
                             f"max_tokens={max_tokens}")
        if max_len > model_cfg.max_seq_len:
            raise ValueError(f"HeldOutEval: max_len={max_len} > model max_seq_len={model_cfg.max_seq_len}")
        self.prompts_SxT, self.lengths_S = padded_rows(prompts, samples_per_task)
        self.device = device if device is not None else jax.devices()[0]
        self.key = jax.random.key(seed)
        self.stop_ids = tuple(tokenizer.stop_ids)
        self._sample = make_sampler(model_cfg, max_tokens=max_tokens, max_len=max_len, temperature=temperature)

    def sample(self, params) -> tuple[np.ndarray, np.ndarray]:
        """(tokens_SxN, logp_SxN) of every sample row (task-major), as numpy."""
        if self.prepare is not None:
            params = self.prepare(params)
        params = jax.device_put(params, self.device)
        args = jax.device_put((self.prompts_SxT, self.lengths_S), self.device)
        return jax.device_get(self._sample(params, *args, self.key))

    def score_outputs(self, outputs: Sequence[Sequence[int]] | np.ndarray) -> dict:
        """Scores of generated token rows (task-major, ``samples_per_task`` per task)."""
        if len(outputs) != len(self.tasks) * self.k:
            raise ValueError(f"HeldOutEval: {len(outputs)} outputs for {len(self.tasks)} tasks x {self.k} samples")
        memo: dict[tuple[int, str], tuple[float | None, bool]] = {}  # equal replies grade equal
        scores, parsed = [], []
        for i, ids in enumerate(outputs):
            text = self.tok.decode(cut_at_stop(ids, self.stop_ids))
            key = (i // self.k, text)
            if key not in memo:
                memo[key] = score_text(self.tasks[i // self.k], text, self.sandbox)
            scores.append(memo[key][0])
            parsed.append(memo[key][1])
        return summarize(scores, parsed)

    def __call__(self, params) -> dict:
        tokens_SxN, _ = self.sample(params)
        return self.score_outputs(tokens_SxN)
