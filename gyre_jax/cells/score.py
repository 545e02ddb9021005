"""The per-step pass: the log-probs an objective reads, once per step, on the step's packed rows.

Some objectives need more than the current policy's log-probs (``PolicyLossConfig.step_passes``):

* ``prox``: the trainer's log-probs under the step's own params (decoupled PPO's
  proximal policy, AReaL; GSPO's per-sequence ratio, which spans micro-batches);
* ``trainer``: under each token's *behaviour* version (the params that sampled it), to
  compare with the engine's recorded log-prob (train-inference mismatch corrections);
* ``ref``: under the reference params (KL to the warm start).

``StepScorer.score`` runs a no-gradient forward (``CellSteps.score_step``, jitted once
per mesh) over the rows of a step's chunk, micro-batch by micro-batch, on the core
cell, before the rows enter the step: a forward per needed param set, and per
behaviour version present among the trainable tokens (a version equal to the step's
is the ``prox`` pass). It then writes, per rollout (the sequence of the sequence-level
entries; all of a rollout's rows are in one chunk), float64 statistics broadcast to
its tokens: ``seq_log_ratio`` = mean over the rollout's trainable tokens of ``prox -
base`` (``base`` the trainer's behaviour log-prob with a correction, else the
engine's) and ``seq_log_mismatch`` = their sum of ``trainer - engine``. Satellites
then compute gradients from the rows alone (no extra params to move).

A behaviour version whose params are gone (a resumed run keeps only its checkpoint's)
gets the engine's log-probs as the trainer's (ratio 1: no correction for those
tokens), counted in ``trainer_unavailable_tokens``.
"""
from __future__ import annotations

import time
from typing import Callable, Mapping

import jax
import numpy as np
from jax.sharding import Mesh

from gyre_jax.cells.train_step import CellSteps, device_micro_batch
from gyre_jax.losses import PolicyLossConfig


def params_bytes(params) -> int:
    """Bytes of a params pytree (global arrays: the whole model)."""
    return int(sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(params)))


class StepScorer:
    def __init__(self, steps: CellSteps, mesh: Mesh, loss_config: PolicyLossConfig, micro_batch_rows: int, *,
                 ref_params=None):
        self.steps, self.mesh, self.b = steps, mesh, int(micro_batch_rows)
        self.passes = loss_config.step_passes()
        self.corrected = loss_config.correction is not None
        if "ref" in self.passes and ref_params is None:
            raise ValueError("StepScorer: kl_coef != 0 needs the reference params")
        self.ref_params = ref_params if "ref" in self.passes else None

    @property
    def needed(self) -> bool:
        return bool(self.passes)

    @property
    def keeps_versions(self) -> bool:
        """Whether the trainer must keep the params of recent versions (the behaviour versions)."""
        return "trainer" in self.passes

    def _forward(self, params, mbs) -> np.ndarray:
        fn = self.steps.score_step(self.mesh)
        bs = self.steps.batch_sharding(self.mesh)
        outs = [fn(params, jax.device_put(mb, bs)) for mb in mbs]  # dispatched together, read once
        return np.concatenate([np.asarray(o) for o in jax.device_get(outs)]).astype(np.float32)

    def warm(self, micro_batch: Mapping, params) -> None:
        """Compile the forward now (the trainer's processor thread, before the first group)."""
        if self.needed:
            jax.block_until_ready(self.steps.score_step(self.mesh)(
                params, jax.device_put(device_micro_batch(micro_batch, where="warm"),
                                       self.steps.batch_sharding(self.mesh))))

    def score(self, rows, rollout_index: np.ndarray, *, version: int,
              params_of: Callable[[int], object | None]) -> dict:
        """Fill ``rows``' score fields in place (a ``PackedRows``); returns what it did."""
        if not self.needed or rows.tokens.shape[0] == 0:
            return {"score_forwards": 0, "trainer_unavailable_tokens": 0, "score_s": 0.0}
        n = rows.tokens.shape[0]
        d = rows.as_dict()
        pad = -n % self.b
        if pad:  # whole micro-batches: one compiled shape (padding rows carry no loss)
            # (-1 routing: padding is routed live, never to a made-up recorded expert 0)
            d = {k: np.concatenate([v, np.full((pad,) + v.shape[1:], -1 if k == "routing" else 0, v.dtype)])
                 for k, v in d.items()}
        mbs = [device_micro_batch({k: v[i:i + self.b] for k, v in d.items()}, where="score")
               for i in range(0, n + pad, self.b)]
        return fill_score_fields(rows, rollout_index, passes=self.passes, corrected=self.corrected,
                                 version=version, params_of=params_of, ref_params=self.ref_params,
                                 forward=lambda p: self._forward(p, mbs)[:n])


def fill_score_fields(rows, rollout_index: np.ndarray, *, passes, corrected: bool, version: int,
                      params_of: Callable[[int], object | None], ref_params, forward) -> dict:
    """The pass on host arrays: ``forward(params) -> logp [n, L]`` for these rows (any device
    layout), the rest as the module docstring says. Also the in-process tools' (rl_offline)."""
    t0 = time.perf_counter()
    stats = {"score_forwards": 0, "trainer_unavailable_tokens": 0}
    mask = rows.loss_mask.astype(bool)
    cache: dict = {}

    def logp_under(key, params):
        if key not in cache:
            cache[key] = np.asarray(forward(params), np.float32)
            stats["score_forwards"] += 1
        return cache[key]

    current = params_of(version)
    if current is None:
        raise RuntimeError(f"StepScorer: no params for the step's own version {version}")
    if "prox" in passes:
        rows.prox_logprobs = logp_under(version, current)
    if "trainer" in passes:
        tr = rows.behavior_logprobs.copy()
        for v in sorted({int(x) for x in rows.target_version[mask]}):
            sel = mask & (rows.target_version == v)
            p = current if v == version else params_of(v)
            if p is None:
                stats["trainer_unavailable_tokens"] += int(sel.sum())
                continue
            tr[sel] = logp_under(v, p)[sel]
        rows.trainer_logprobs = tr
    if "ref" in passes:
        rows.ref_logprobs = logp_under("ref", ref_params)
    ridx = np.where(mask, rollout_index, 0).astype(np.int64)
    m = ridx.max(initial=0) + 1
    if "seq_log_ratio" in passes:
        base = (rows.trainer_logprobs if corrected else rows.behavior_logprobs).astype(np.float64)
        x = rows.prox_logprobs.astype(np.float64) - base
        cnt = np.bincount(ridx[mask], minlength=m)
        mean = np.bincount(ridx[mask], weights=x[mask], minlength=m) / np.maximum(cnt, 1)
        rows.seq_log_ratio = np.where(mask, mean[ridx], 0.0).astype(np.float32)
    if "seq_log_mismatch" in passes:
        x = rows.trainer_logprobs.astype(np.float64) - rows.behavior_logprobs.astype(np.float64)
        tot = np.bincount(ridx[mask], weights=x[mask], minlength=m)
        rows.seq_log_mismatch = np.where(mask, tot[ridx], 0.0).astype(np.float32)
    return {**stats, "score_s": time.perf_counter() - t0}
