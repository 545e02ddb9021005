"""The per-step pass (``cells.score.StepScorer``) on a real model and cell mesh.

Rows of rollouts sampled by three policy versions (the step's own, the one before,
and one whose params are gone) are scored once for GSPO with a sequence-level
mismatch correction and KL to a reference: every field must equal a direct forward
of the right params on each row (a plain ``Transformer.apply`` + ``log_softmax``), the
per-rollout statistics a float64 computation over the rollout's tokens, and the sum of
the cells' ``grad_step`` over the micro-batches must equal one full-batch gradient whose
sequence statistics come from the rollout ids in the batch (not from the pass).
"""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from gyre_jax import cells
from gyre_jax.cells.loss import policy_loss_fn
from gyre_jax.cells.score import StepScorer
from gyre_jax.losses import METRIC_REDUCTIONS, PolicyLossConfig, loss_from_logits
from gyre_jax.model import Transformer, init_boxed, init_params, model_config_tiny, param_logical_axes
from gyre_jax.trajectory.node import TreeNode
from gyre_jax.trajectory.serialize import pack_rows, serialize_tree

MODEL = model_config_tiny()
OPT = cells.OptimizerConfig(learning_rate=1e-3)
VERSION = 5
B, L, M = 2, 32, 3  # rows per micro-batch, row length, micro-batches
LOSS = PolicyLossConfig.create(loss="gspo", eps_low=0.05, eps_high=0.05, mismatch="tis_seq", mismatch_cap=1.5,
                               kl_coef=0.1)


def _rows(seed=0):
    """M * B rows of two single-rollout trees each; versions VERSION, VERSION - 1, VERSION - 2."""
    rng = np.random.default_rng(seed)
    trees, versions = [], []
    for r in range(M * B * 2):
        v = VERSION - r % 3

        def span(n, trainable, children=()):
            lp = (np.log(1.0 / MODEL.vocab_size) + 0.3 * rng.standard_normal(n)).astype(np.float32)
            return TreeNode.span(rng.integers(1, MODEL.vocab_size, n), trainable=trainable, logprobs=lp,
                                 children=children, policy_version=v)

        trees.append(serialize_tree(span(3, False, [span(int(rng.integers(5, 10)), True)])))
        versions.append(v)
    rows = pack_rows([trees[2 * i: 2 * i + 2] for i in range(M * B)], L)
    rollout = np.where(rows.segment_ids > 0, 2 * np.arange(M * B)[:, None] + rows.segment_ids - 1, -1)
    n = np.bincount(rollout[rows.loss_mask], minlength=len(trees))
    rows.loss_weights = np.where(rows.loss_mask, 1.0 / (n[np.maximum(rollout, 0)] * len(trees)), 0.0).astype(np.float32)
    adv = rng.choice([-1.0, -0.3, 0.5, 1.2], len(trees)).astype(np.float32)
    rows.advantages = np.where(rollout >= 0, adv[np.maximum(rollout, 0)], 0.0).astype(np.float32)
    return rows, rollout.astype(np.int32)


def _direct_logp(params, d):
    """Independent of the pass: log_softmax of the full logits, one device, every row at once."""
    logits = Transformer(MODEL).apply(params, d["tokens"], d["positions"], d["segment_ids"], d["subtree_end"])
    return np.asarray(jnp.take_along_axis(jax.nn.log_softmax(logits), d["targets"][..., None], -1)[..., 0], np.float64)


@pytest.fixture(scope="module")
def scored():
    cs = cells.split_cells(cells.CellConfig(cell_size=2))
    mesh = cs[0].train_mesh
    spec = cells.StateSpec.create(functools.partial(init_boxed, MODEL), cells.make_optimizer(OPT, param_logical_axes(MODEL)))
    steps = cells.CellSteps(spec, policy_loss_fn(MODEL, LOSS), cells.make_schedule(OPT), reductions=METRIC_REDUCTIONS)
    ps = steps.param_shardings(mesh)
    cur, old, ref = (jax.device_put(init_params(MODEL, jax.random.key(k)), ps) for k in (1, 2, 3))
    rows, rollout = _rows()
    behavior = rows.behavior_logprobs.copy()
    scorer = StepScorer(steps, mesh, LOSS, B, ref_params=ref)
    stats = scorer.score(rows, rollout, version=VERSION, params_of={VERSION: cur, VERSION - 1: old}.get)
    return dict(steps=steps, mesh=mesh, cur=cur, old=old, ref=ref, rows=rows, rollout=rollout, stats=stats,
                behavior=behavior)


def test_fields_equal_direct_forwards(scored):
    rows, rollout, stats = scored["rows"], scored["rollout"], scored["stats"]
    d = {k: jnp.asarray(v) for k, v in rows.as_dict().items()}
    mask = rows.loss_mask
    host = {k: jax.device_get(scored[k]) for k in ("cur", "old", "ref")}
    lp = {k: _direct_logp(p, d) for k, p in host.items()}
    np.testing.assert_allclose(rows.prox_logprobs[mask], lp["cur"][mask], atol=2e-5)
    np.testing.assert_allclose(rows.ref_logprobs[mask], lp["ref"][mask], atol=2e-5)
    v = rows.target_version
    for ver, want in ((VERSION, lp["cur"]), (VERSION - 1, lp["old"]), (VERSION - 2, scored["behavior"])):
        sel = mask & (v == ver)
        assert sel.any()
        np.testing.assert_allclose(rows.trainer_logprobs[sel], want[sel], atol=2e-5, err_msg=str(ver))
    assert stats["trainer_unavailable_tokens"] == int((mask & (v == VERSION - 2)).sum())
    assert stats["score_forwards"] == 3  # the step's params, the version before, the reference
    # Per rollout, float64: GSPO's mean of prox - trainer, the correction's sum of trainer - engine.
    for r in np.unique(rollout[mask]):
        on = mask & (rollout == r)
        tr = rows.trainer_logprobs[on].astype(np.float64)
        np.testing.assert_allclose(rows.seq_log_ratio[on], np.mean(rows.prox_logprobs[on] - tr), atol=1e-6)
        np.testing.assert_allclose(rows.seq_log_mismatch[on], np.sum(tr - rows.behavior_logprobs[on]), atol=1e-5)


def test_micro_batch_gradients_sum_to_the_full_batch(scored):
    """grad_step per micro-batch (the pass's fields) summed == one full-batch gradient (sequence ids)."""
    steps, mesh, rows, rollout = scored["steps"], scored["mesh"], scored["rows"], scored["rollout"]
    d = rows.as_dict()
    grad_step = steps.grad_step(mesh)
    acc, loss = None, 0.0
    for i in range(M):
        mb = cells.train_step.device_micro_batch({k: v[i * B: (i + 1) * B] for k, v in d.items()})
        g, s = grad_step(scored["cur"], jax.device_put(mb, steps.batch_sharding(mesh)))
        acc = g if acc is None else jax.tree.map(jnp.add, acc, g)
        loss += float(s["loss"])
        assert float(s["mismatch_frac_truncated"]) >= 0 and "kl_ref" in s

    full = {k: jnp.asarray(v) for k, v in d.items() if k not in ("seq_log_ratio", "seq_log_mismatch")}
    full["sequence_ids"] = jnp.asarray(np.maximum(rollout, 0))  # whole rollouts in the batch: in-batch statistics
    params = jax.device_get(scored["cur"])

    @jax.jit
    def reference(p):
        def f(p):
            logits = Transformer(MODEL).apply(p, full["tokens"], full["positions"], full["segment_ids"],
                                              full["subtree_end"])
            return loss_from_logits(logits, full, LOSS)[0]

        return jax.value_and_grad(f)(p)

    want_loss, want = reference(params)
    np.testing.assert_allclose(loss, float(want_loss), rtol=1e-5, atol=1e-7)
    got = jax.device_get(acc)
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        np.testing.assert_allclose(g, w, rtol=0, atol=2e-5 * float(np.abs(w).max()) + 1e-9)
