"""Supervised warm start on scripted demonstrations (before RL).

A randomly initialised byte-level model never writes a well-formed tool call, so
RL from scratch would see reward 0 everywhere and learn nothing in a CPU demo.
We replay each task's ideal actions through the real agent loop
(``gyre_jax.agents.demos``), render every assistant turn's prompt exactly as the
proxy does (``serving.api_openai.parse_chat`` -> the same chat template), and
train the assistant tokens (text, tool-call tokens, then ``<|im_end|>``) through the
RL loop's loss path (``losses.loss_from_logits`` with the registered ``nll`` objective)
and the registered ``token_mean`` weights.

Host side: ``demo_trees`` (tasks -> one prefix-sharing tree per demonstration;
``demo_examples``: its (prompt_ids, target_ids) pairs). Device side: one
jitted step on the default device; the caller lays the result out on the cells.
"""
from __future__ import annotations

import dataclasses
import logging
import time
from typing import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
import optax

from gyre_jax.agents.config import HarnessConfig
from gyre_jax.agents.demos import demonstration
from gyre_jax.agents.tasks.base import Task
from gyre_jax.errors import ConfigError
from gyre_jax.losses import PolicyLossConfig, build_loss_weights, loss_from_logits
from gyre_jax.model import ModelConfig, Transformer
from gyre_jax.rl.progress import Progress
from gyre_jax.rl.sft_config import NOISE_KINDS
from gyre_jax.serving.api_common import ApiError
from gyre_jax.serving.api_openai import parse_chat
from gyre_jax.serving.tokenizer import Tokenizer
from gyre_jax.trajectory.binpack import pack_trees
from gyre_jax.trajectory.node import TreeNode
from gyre_jax.trajectory.records import ModelCallRecord
from gyre_jax.trajectory.tree import build_tree
from gyre_jax.trajectory.vocab import ROLE_MAIN

log = logging.getLogger(__name__)
_KEYS = ("tokens", "targets", "positions", "segment_ids", "subtree_end", "loss_weights", "loss_mask")


def assistant_ids(prompt: Sequence[int] | np.ndarray, extended: Sequence[int] | np.ndarray, tok: Tokenizer, *,
                  where: str) -> list[int]:
    """What the model generates for an assistant turn: the template's own rendering of it.

    ``extended`` renders the conversation up to and including the turn; the target is
    what follows ``prompt`` up to and including the first stop id. Building it from
    the template (not from content + tool-call spans) matters for real chat templates:
    Qwen's puts a newline before a call and an empty think block in the latest turn, so
    a warm start on any other form would teach the model a turn whose re-render drifts.
    """
    if list(extended[: len(prompt)]) != list(prompt):
        raise ValueError(f"{where}: rendering the assistant turn changed the prompt before it (template not prefix-stable)")
    rest = list(extended[len(prompt):])
    stops = set(tok.stop_ids)
    for i, t in enumerate(rest):
        if t in stops:
            return rest[: i + 1]
    raise ValueError(f"{where}: the rendered assistant turn has no end-of-turn token")


def noisy_tasks(tasks: Sequence[Task], fraction: float, seed: int, kind: str = "reverse"
                ) -> tuple[list[Task], np.ndarray]:
    """Copies of ``tasks`` where exactly ``round(fraction * len(tasks))`` of them (chosen by
    ``seed``) get a bad demonstration. ``kind`` 'reverse', 'one_char' and 'random' give a
    WRONG expected answer of the same length, never equal to the right one ('reverse': the
    right answer reversed; 'one_char': one position replaced by another symbol of the op's
    alphabet; 'random': a fresh string over that alphabet; palindromes fall back from
    'reverse' to 'one_char'); 'give_up' keeps the answer but marks the task
    (``params['demo_give_up']``) so its demonstration just finishes without writing.
    Returns (tasks, corrupted mask).

    Why: SFT on clean demonstrations of the 'tiny' family lands anywhere from chance to ~0.95
    depending on a few dozen steps, leaving RL either nothing to learn or no signal. A noisy
    mix is meant to leave a MIXTURE policy (format right, answer right only part of the
    time) with headroom for RL. Measured (docs/results.md): 'random' removes the
    signal to read the argument (800 steps stayed at chance); 'reverse' gives SFT ~0.66 but
    as scattered per-character errors, not a reversed-answer mode, and RL still stayed flat.
    Only the 'tiny' family, whose scripted demonstration writes ``params['expected']``,
    supports this.
    """
    if not 0.0 <= fraction < 1.0:
        raise ValueError(f"sft.noisy_tasks: fraction must be in [0, 1), got {fraction}")
    if kind not in NOISE_KINDS:
        raise ValueError(f"sft.noisy_tasks: kind={kind!r}; known: {NOISE_KINDS}")
    from gyre_jax.agents.tasks import tiny

    rng = np.random.default_rng(seed)
    n_bad = int(round(fraction * len(tasks)))
    mask = np.zeros(len(tasks), bool)
    mask[rng.permutation(len(tasks))[:n_bad]] = True
    out = []
    for task, bad in zip(tasks, mask):
        if not bad:
            out.append(task)
            continue
        if task.family != tiny.FAMILY:
            raise ValueError(f"sft.noisy_tasks: task {task.task_id} is family {task.family!r}; noisy "
                             f"demonstrations are defined only for {tiny.FAMILY!r}")
        if kind == "give_up":  # the demonstration finishes without writing the answer
            out.append(dataclasses.replace(task, params={**task.params, "demo_give_up": True}))
            continue
        right = task.params["expected"]
        alphabet = tiny.OPS[task.params["op"]][0]
        wrong = right[::-1] if kind == "reverse" else right
        if wrong == right and kind != "random":  # one_char, or a palindrome under 'reverse'
            i = int(rng.integers(len(right)))
            others = [c for c in alphabet if c != right[i]]
            wrong = right[:i] + others[int(rng.integers(len(others)))] + right[i + 1:]
        while wrong == right:
            wrong = "".join(alphabet[i] for i in rng.integers(len(alphabet), size=len(right)))
        out.append(dataclasses.replace(task, params={**task.params, "expected": wrong}))
    return out, mask


def demo_calls(tasks: Sequence[Task], harness: HarnessConfig, tok: Tokenizer
               ) -> list[list[tuple[np.ndarray, np.ndarray]]]:
    """Per task, (prompt_ids, target_ids) of every model call of its scripted demonstration."""
    out, cut = [], ""
    for task in tasks:
        demo = demonstration(task, harness, text_format=not harness.send_tools_schema)
        calls = []
        for k, call in enumerate(demo.calls):
            body = {"model": harness.model, "messages": call.messages, "max_tokens": 1}
            if call.tools:
                body["tools"] = call.tools
            where = f"config.sft: demonstration of task {task.task_id}, call {k} ({call.role})"
            try:
                prompt = parse_chat(body, tok).prompt_ids
                extended = parse_chat({**body, "messages": call.messages + [call.reply]}, tok).prompt_ids
            except ApiError as e:  # e.g. Llama-3.1's template refuses several tool calls in one turn
                raise ConfigError(f"{where}: the chat template cannot render it: {e}") from None
            target = assistant_ids(prompt, extended, tok, where=where)
            if len(target) > harness.max_tokens and not cut:  # the policy could never finish what it was taught
                cut = f"{where}: the demonstrated reply is {len(target)} tokens"
            calls.append((np.asarray(prompt, np.int32), np.asarray(target, np.int32)))
        out.append(calls)
    if cut:  # loud, not fatal: tests train tiny warm starts they never sample from
        log.warning("%s but harness.max_tokens=%d: the rollouts cut such replies short; raise config.harness."
                    "max_tokens", cut, harness.max_tokens)
    return out


def demo_examples(tasks: Sequence[Task], harness: HarnessConfig, tok: Tokenizer) -> list[tuple[np.ndarray, np.ndarray]]:
    """(prompt_ids, target_ids) per model call of each task's scripted demonstration."""
    return [pair for calls in demo_calls(tasks, harness, tok) for pair in calls]


def demo_trees(tasks: Sequence[Task], harness: HarnessConfig, tok: Tokenizer) -> list[TreeNode]:
    """One prefix-sharing tree per demonstration, rebuilt from its calls exactly as the
    trainer rebuilds a rollout's (``trajectory.tree``): a multi-call episode's later calls
    repeat the earlier context, so training the tree once instead of every (prompt, target)
    pair costs its unique tokens only (1.9x fewer on the 'tiny_agent' family)."""
    trees = []
    for task, calls in zip(tasks, demo_calls(tasks, harness, tok)):
        records = [ModelCallRecord(
            run_id="sft", rollout_id="demo", task_id=task.task_id, group_id="demo", agent_id=0, parent_agent_id=None,
            role=ROLE_MAIN, call_index=k, prompt_ids=p, output_ids=t, output_logprobs=np.zeros(len(t), np.float32),
            policy_version=0, t_start=0.0, t_end=0.0, finish_reason="stop") for k, (p, t) in enumerate(calls)]
        trees.append(build_tree(records))
    return trees


def _as_tree(example) -> TreeNode:
    if isinstance(example, TreeNode):
        return example
    p, t = example
    return TreeNode.span(p, children=[TreeNode.span(t, trainable=True)])


def _batch(examples, order, start: int, rows: int, row_len: int):
    """Examples (trees, or (prompt, target) pairs) from ``order[start:]`` packed into exactly
    ``rows`` rows; (arrays, next start). A tree longer than a row is split by the packer."""
    trees: list = []  # TreeNode, or a (prompt, target) pair packed as one
    used, i = 0, start
    budget = int(0.9 * rows * row_len)
    while True:
        example = examples[order[i % len(order)]]
        tree = _as_tree(example)
        n = tree.num_tokens()
        if n > row_len and not isinstance(example, TreeNode):
            raise ValueError(f"sft: a demonstration needs {n} tokens > row_len={row_len}")
        if trees and used + n > budget:
            break
        trees.append(tree)
        used += n
        i += 1
    while True:
        packed = pack_trees(trees, [0.0] * len(trees), row_len, min_rows=rows)
        if packed.rows.tokens.shape[0] <= rows or len(trees) == 1:
            break
        trees.pop()
        i -= 1
    if packed.rows.tokens.shape[0] > rows:
        raise ValueError(f"sft: one demonstration needs {packed.rows.tokens.shape[0]} rows of {row_len} tokens "
                         f"> sft.rows={rows}")
    out = {k: getattr(packed.rows, k) for k in _KEYS}
    # Token-mean NLL (the usual SFT objective): every demonstrated token counts the same, so a
    # choice made by a fraction f of the demonstrations is imitated with probability ~f. The
    # packer's rollout-first weights would favour short demonstrations' tokens (1 / length).
    mask = out["loss_mask"]
    out["loss_weights"], _ = build_loss_weights("token_mean", mask, np.zeros(mask.shape, np.int32), 1)
    return out, i


SFT_LOSS = PolicyLossConfig(loss="nll", entropy_metric=False)  # the RL loop's loss path, objective 'nll'


def make_sft_step(model_cfg: ModelConfig, tx: optax.GradientTransformation) -> Callable:
    model = Transformer(model_cfg)

    def loss_fn(params, b):
        logits = model.apply(params, b["tokens"], b["positions"], b["segment_ids"], b["subtree_end"])
        loss, _ = loss_from_logits(logits, b, SFT_LOSS)
        correct = (jnp.argmax(logits, -1) == b["targets"]) & b["loss_mask"]
        return loss, jnp.sum(correct) / jnp.maximum(jnp.sum(b["loss_mask"]), 1)

    def step(params, opt_state, b):
        (loss, acc), grads = jax.value_and_grad(loss_fn, has_aux=True)(params, b)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, {"loss": loss, "accuracy": acc}

    return jax.jit(step, donate_argnums=(0, 1))


def warm_start(params, model_cfg: ModelConfig, examples, *, steps: int, rows: int, row_len: int,
               learning_rate: float, seed: int, progress: bool = True) -> tuple[object, list[dict]]:
    """``steps`` supervised updates on ``examples``; returns (params, per-step metrics)."""
    if steps == 0:
        return params, []
    warmup = max(1, steps // 10) if steps > 1 else 0  # optax needs decay steps after the warm-up
    sched = optax.warmup_cosine_decay_schedule(0.0, learning_rate, warmup, steps, learning_rate * 0.1)
    tx = optax.chain(optax.clip_by_global_norm(1.0), optax.adam(sched))
    params = jax.tree.map(lambda x: x.copy(), params)  # the caller's copy is not donated
    opt_state = tx.init(params)
    step = make_sft_step(model_cfg, tx)
    order = np.random.default_rng(seed).permutation(len(examples))
    history, start, pending, t0 = [], 0, None, time.perf_counter()
    bar = Progress(total=steps, desc="sft warm start", enabled=progress, every_s=10.0, line_per_step=False)
    for s in range(steps):
        b, start = _batch(examples, order, start, rows, row_len)
        params, opt_state, m = step(params, opt_state, b)
        if pending is not None:  # read one step late so the host packs while the device runs
            history.append({k: float(v) for k, v in jax.device_get(pending).items()})
            bar.set_status(f"loss={history[-1]['loss']:.3f} acc={history[-1]['accuracy']:.2f}")
        bar.step()
        pending = m
    history.append({k: float(v) for k, v in jax.device_get(pending).items()})
    bar.close()
    log.info("sft: %d steps in %.1fs, loss %.3f -> %.3f", steps, time.perf_counter() - t0, history[0]["loss"],
             history[-1]["loss"])
    return params, history
