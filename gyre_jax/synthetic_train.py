"""Synthetic training (job 'train_synthetic'): train the tiny model on synthetic tree-packed data.

Until the RL loop exists this shows the training path end to end on CPU: random
prefix-sharing trees (prompts, retries, nested turns, compaction-like fresh
contexts, sub-agents) -> gyre_jax.trajectory.binpack.pack_trees (splitting, FFD
packing, rollout-first loss weights) -> the tree-masked Transformer ->
gyre_jax.losses.token_logprobs -> optax AdamW. The loss is the weighted token
NLL sum(w * -logp), weights from the counting rule (they sum to 1 per step).

The synthetic language is learnable: every span of a tree continues one
arithmetic progression ``a, a+s, a+2s, ... (mod V)`` whose step ``s`` is fixed
per tree; each model output (a trainable span) restarts at a random token
``a``, so only its first token is unpredictable. A model that infers ``s`` from
the context gets most targets right; the loss falls from ~ln(V).
"""
from __future__ import annotations

import contextlib
import dataclasses
import functools
import hashlib
import json
import os
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P
from tqdm.auto import tqdm

from gyre_jax.losses import token_logprobs
from gyre_jax.model import ModelConfig, Transformer, count_params, init_params
from gyre_jax.trajectory.binpack import pack_trees, serialized_len
from gyre_jax.trajectory.node import TreeNode

_BATCH_KEYS = ("tokens", "targets", "positions", "segment_ids", "subtree_end", "loss_weights", "loss_mask")


@dataclasses.dataclass(frozen=True, kw_only=True)
class DemoConfig:
    seed: int
    steps: int
    rows: int  # rows per step (static shape: one compile)
    row_len: int
    learning_rate: float
    warmup_steps: int
    weight_decay: float
    grad_clip: float
    prompt_len: int
    node_len: int
    depth: int
    max_branches: int
    subagent_prob: float
    compaction_prob: float
    max_step: int  # progression steps s are drawn from 1..max_step
    log_every: int
    save_params: bool = False  # write workdir/params.npz at the end (process 0: params are replicated)

    def __post_init__(self):
        for name in ("steps", "rows", "row_len", "prompt_len", "node_len", "depth", "max_branches", "max_step", "log_every"):
            if getattr(self, name) <= 0:
                raise ValueError(f"DemoConfig.{name} must be > 0, got {getattr(self, name)}")
        for name in ("subagent_prob", "compaction_prob"):
            if not 0.0 <= getattr(self, name) <= 1.0:
                raise ValueError(f"DemoConfig.{name} must be in [0, 1], got {getattr(self, name)}")
        if self.learning_rate <= 0 or self.warmup_steps < 0 or self.grad_clip <= 0:
            raise ValueError("DemoConfig: learning_rate and grad_clip must be > 0, warmup_steps >= 0")
        longest_path = self.prompt_len * 5 // 4 + 1 + self.depth * (self.node_len * 3 // 2 + 1) * 2
        if longest_path > self.row_len:
            raise ValueError(
                f"DemoConfig: a path can reach {longest_path} tokens (prompt_len, depth, node_len) "
                f"> row_len={self.row_len}; trees could not be packed"
            )


def _split_config(config) -> tuple[DemoConfig, ModelConfig]:
    d = config.to_dict() if hasattr(config, "to_dict") else dict(config)
    model = d.pop("model")
    d.pop("job", None)
    d.pop("workdir", None)
    d.pop("num_cpu_devices", None)  # launch/main.py applies it before JAX starts; the job uses jax.devices()
    return DemoConfig(**d), ModelConfig(**model)


class TreeSampler:
    """Random trees of the synthetic progression language (module docstring)."""

    def __init__(self, cfg: DemoConfig, vocab: int, rng: np.random.Generator):
        self.cfg, self.vocab, self.rng = cfg, vocab, rng

    def _run(self, start: int, step: int, n: int) -> np.ndarray:
        # Token 0 is padding; progressions live in 1..V-1.
        return (1 + (start - 1 + step * np.arange(n)) % (self.vocab - 1)).astype(np.int32)

    def _len(self, mean: int) -> int:
        return int(self.rng.integers(max(1, mean // 2), mean * 3 // 2 + 1))

    def _turn(self, depth: int, step: int, **meta) -> TreeNode:
        """A model output (restarts the progression at a random token), then maybe
        a tool result continuing it and further turns (retries = several children)."""
        cfg = self.cfg
        out = self._run(int(self.rng.integers(1, self.vocab)), step, self._len(cfg.node_len))
        node = TreeNode.span(out, trainable=True, **meta)
        if depth < cfg.depth:
            tool = TreeNode.span(self._run(int(out[-1]) + step, step, self._len(cfg.node_len)), **meta)
            k = int(self.rng.integers(1, cfg.max_branches + 1))
            tool.children = [self._turn(depth + 1, step, **meta) for _ in range(k)]
            node.children = [tool]
        return node

    def tree(self) -> TreeNode:
        cfg = self.cfg
        step = int(self.rng.integers(1, cfg.max_step + 1))
        role = "subagent" if self.rng.random() < cfg.subagent_prob else "main"
        meta = dict(role=role, agent_id=int(role == "subagent"))
        prompt = self._run(int(self.rng.integers(1, self.vocab)), step, self._len(cfg.prompt_len))
        root = TreeNode.span(prompt[: max(1, len(prompt) // 2)], **meta)  # "system prompt"
        task = TreeNode.span(prompt[len(root.tokens) :], **meta) if len(prompt) > 1 else None
        k = int(self.rng.integers(1, cfg.max_branches + 1))
        turns = [self._turn(1, step, **meta) for _ in range(k)]  # retries of the first turn
        if task is not None:
            task.children = turns
            root.children = [task]
        else:
            root.children = turns
        if self.rng.random() < cfg.compaction_prob:
            # A fresh context sharing only the system prompt (a compaction summary).
            summary = TreeNode.span(self._run(int(root.tokens[-1]) + step, step, self._len(cfg.node_len)), role="summary")
            summary.children = [self._turn(cfg.depth, step, role="summary")]
            root.children.append(summary)
        return root

    def batch(self) -> tuple[dict[str, np.ndarray], int]:
        """Trees packed into exactly ``rows`` rows; returns (arrays, number of trees)."""
        cfg = self.cfg
        trees: list[TreeNode] = []
        used = 0
        budget = int(0.9 * cfg.rows * cfg.row_len)
        while True:
            t = self.tree()
            n = serialized_len(t)
            if trees and used + n > budget:
                break
            trees.append(t)
            used += n
        while True:
            packed = pack_trees(trees, [0.0] * len(trees), cfg.row_len, min_rows=cfg.rows)
            if packed.rows.tokens.shape[0] <= cfg.rows or len(trees) == 1:
                break
            trees.pop()  # FFD needed one row too many: drop the last tree (rare)
        if packed.rows.tokens.shape[0] > cfg.rows:
            raise ValueError(f"demo: one tree needs {packed.rows.tokens.shape[0]} rows > rows={cfg.rows}")
        return {k: getattr(packed.rows, k) for k in _BATCH_KEYS}, len(trees)


def make_train_step(model: Transformer, tx: optax.GradientTransformation, mesh: Mesh):
    """The jitted step, data parallel over ``mesh`` ('data' axis): rows split, params and optimizer state replicated."""

    def loss_fn(params, batch):
        logits = model.apply(params, batch["tokens"], batch["positions"], batch["segment_ids"], batch["subtree_end"])
        logp = token_logprobs(logits, batch["targets"])
        loss = -jnp.sum(batch["loss_weights"] * logp)
        correct = (jnp.argmax(logits, -1) == batch["targets"]) & batch["loss_mask"]
        acc = jnp.sum(correct) / jnp.maximum(jnp.sum(batch["loss_mask"]), 1)
        return loss, acc

    def train_step(params, opt_state, batch):
        (loss, acc), grads = jax.value_and_grad(loss_fn, has_aux=True)(params, batch)
        updates, opt_state = tx.update(grads, opt_state, params)
        params = optax.apply_updates(params, updates)
        return params, opt_state, {"loss": loss, "accuracy": acc, "grad_norm": optax.tree.norm(grads)}

    replicated, rows = NamedSharding(mesh, P()), NamedSharding(mesh, P("data"))
    return jax.jit(train_step, in_shardings=(replicated, replicated, rows), out_shardings=replicated, donate_argnums=(0, 1))


def global_batch(batch: dict[str, np.ndarray], mesh: Mesh) -> dict[str, jax.Array]:
    """Rows split over the 'data' axis. Every process holds the same host batch and
    hands over only the rows of its own devices (no cross-process transfer)."""
    sharding = NamedSharding(mesh, P("data"))
    return {k: jax.make_array_from_callback(v.shape, sharding, v.__getitem__) for k, v in batch.items()}


def local_params(params) -> dict[str, np.ndarray]:
    """This process's copy of every (replicated) leaf, keyed by its tree path, in tree order."""
    return {jax.tree_util.keystr(k): np.asarray(v.addressable_shards[0].data)
            for k, v in jax.tree_util.tree_leaves_with_path(params)}


def params_digest(host_params: dict[str, np.ndarray]) -> str:
    """sha256 of every leaf's bytes in tree order: two runs trained the same params iff equal."""
    h = hashlib.sha256()
    for leaf in host_params.values():
        h.update(np.ascontiguousarray(leaf).tobytes())
    return h.hexdigest()


def run(config, workdir: str) -> list[dict]:
    """Train, print loss with a progress bar, write ``workdir/metrics.jsonl``; return the metrics.

    Data parallel over every device of every process (``jax.devices()``): each
    process draws the same batches (same seed) and feeds its devices' rows; only
    process 0 prints and writes files. Returns the same metrics in every process.
    """
    cfg, model_cfg = _split_config(config)
    mesh = Mesh(np.array(jax.devices()), ("data",))
    if cfg.rows % mesh.size:
        raise ValueError(f"train_synthetic: rows={cfg.rows} must be a multiple of the {mesh.size} devices "
                         f"({jax.process_count()} processes); set --config.rows")
    primary = jax.process_index() == 0
    if primary:
        os.makedirs(workdir, exist_ok=True)
    sampler = TreeSampler(cfg, model_cfg.vocab_size, np.random.default_rng(cfg.seed))
    params, opt_state, tx, schedule = _init_state(cfg, model_cfg, mesh)
    train_step = make_train_step(Transformer(model_cfg), tx, mesh)
    say = functools.partial(print, flush=True) if primary else (lambda *a, **k: None)
    say(f"train_synthetic: {count_params(params):,} params, {cfg.steps} steps of {cfg.rows}x{cfg.row_len} "
        f"tree-packed tokens over {mesh.size} devices ({jax.process_count()} processes), workdir={workdir}")
    path = os.path.join(workdir, "metrics.jsonl")
    t_start = time.perf_counter()
    params, history = _train_loop(cfg, sampler, train_step, params, opt_state, mesh, schedule,
                                  path if primary else None, t_start)
    first = np.mean([h["loss"] for h in history[: cfg.log_every]])
    last = np.mean([h["loss"] for h in history[-cfg.log_every :]])
    say(f"train_synthetic: loss {first:.3f} -> {last:.3f} (mean of first/last {cfg.log_every} steps), "
        f"accuracy {history[-1]['accuracy']:.2f}, {time.perf_counter() - t_start:.1f}s; metrics: {path}")
    if primary:
        final: dict[str, Any] = local_params(params)  # savez's stub would take an array for allow_pickle
        say(f"train_synthetic: final params sha256 {params_digest(final)}")
        if cfg.save_params:
            np.savez(os.path.join(workdir, "params.npz"), **final)
    return history


def _init_state(cfg, model_cfg, mesh: Mesh):
    """(params, optimizer state, optimizer, lr schedule): born replicated on every device."""
    replicated = NamedSharding(mesh, P())
    # 'rbg' (XLA's RngBitGenerator): compiles in about half of threefry's CPU time, which is most
    # of the job's start-up on a small model.
    init = jax.jit(functools.partial(init_params, model_cfg), out_shardings=replicated)
    params = init(jax.random.key(cfg.seed, impl="rbg"))
    schedule = optax.warmup_cosine_decay_schedule(
        0.0, cfg.learning_rate, max(cfg.warmup_steps, 1), max(cfg.steps, cfg.warmup_steps + 1), cfg.learning_rate * 0.1
    )
    tx = optax.chain(optax.clip_by_global_norm(cfg.grad_clip), optax.adamw(schedule, weight_decay=cfg.weight_decay))
    opt_state = jax.jit(tx.init, out_shardings=replicated)(params)
    return params, opt_state, tx, schedule


def _train_loop(cfg, sampler, train_step, params, opt_state, mesh: Mesh, schedule, path: str | None,
                t_start: float):
    """The steps, each step's metrics read one step late so dispatch overlaps; (final params, metrics).
    ``path``: where this process writes metrics.jsonl (None: it writes nothing and shows no bar)."""
    history: list[dict] = []
    pending = None  # (step, host-side info, device metrics)
    with (open(path, "w") if path is not None else contextlib.nullcontext()) as f, \
            tqdm(total=cfg.steps, desc="train_synthetic", unit="step", disable=path is None) as bar:

        def flush(item):
            step, info, metrics = item
            m = {k: float(v) for k, v in jax.device_get(metrics).items()}  # replicated: every process reads its copy
            rec = {"step": step, **m, **info, "lr": float(schedule(step)), "elapsed_s": time.perf_counter() - t_start}
            history.append(rec)
            if f is not None:
                f.write(json.dumps(rec) + "\n")
                f.flush()
            bar.set_postfix(loss=f"{m['loss']:.3f}", acc=f"{m['accuracy']:.2f}")
            bar.update(1)

        for step in range(cfg.steps):
            batch, n_trees = sampler.batch()
            info = {"trees": n_trees, "trainable_tokens": int(batch["loss_mask"].sum()),
                    "fill": float((batch["segment_ids"] > 0).mean())}
            params, opt_state, metrics = train_step(params, opt_state, global_batch(batch, mesh))
            if pending is not None:
                flush(pending)
            pending = (step, info, metrics)
        flush(pending)
    return params, history
