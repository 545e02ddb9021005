"""The RL loop's objective plumbing: the reference policy (KL), the per-step pass, their memory.

Reference params (``config.train.kl_coef > 0``): the warm start, i.e. the params the
run's RL starts from (after SFT, or the checkpoint at ``model.hf_path``). A fresh run
keeps a copy on the core cell and writes it to ``<workdir>/reference/params.npz``; a
resumed run reads it back (or reloads ``model.hf_path`` when there was no SFT), so
the KL target never moves across restarts. A run started without ``kl_coef`` has no
saved reference: turning KL on in its workdir is an error naming the fix.

``describe`` is the one line the launcher prints: what the objective computes per step
and what it holds in memory (the reference, the kept behaviour versions).
"""
from __future__ import annotations

import logging
import os

import jax
import numpy as np

from gyre_jax.cells.score import StepScorer, params_bytes
from gyre_jax.errors import RunFailed

log = logging.getLogger(__name__)
REFERENCE_FILE = os.path.join("reference", "params.npz")


def _reloadable(cfg) -> bool:
    """The warm start is exactly model.hf_path's weights (no SFT after loading). A LoRA run's reference is
    its starting adapters (rl/lora_run.py): always kept in the file."""
    return bool(cfg.hf_path) and cfg.sft.steps == 0 and not cfg.train.lora.enabled


def _on_core(tree, steps, mesh):
    return jax.tree.map(lambda x, s: jax.device_put(np.asarray(x) if not isinstance(x, jax.Array) else x, s).copy(),
                        tree, steps.param_shardings(mesh))


def keep_reference(cfg, workdir: str, params, steps, mesh):
    """A fresh run: the warm start as the reference (None without KL); saved for resumes."""
    if not cfg.train.kl_coef:
        return None
    ref = _on_core(params, steps, mesh)
    if jax.process_index() == 0 and not _reloadable(cfg):
        path = os.path.join(workdir, REFERENCE_FILE)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        leaves, _ = jax.tree_util.tree_flatten_with_path(jax.device_get(ref))
        tmp = path + ".tmp.npz"
        np.savez(tmp, **{jax.tree_util.keystr(k): v for k, v in leaves})
        os.replace(tmp, path)
        log.info("rl: reference params (the warm start) saved to %s", path)
    return ref


def restore_reference(cfg, workdir: str, steps, mesh):
    """A resumed run: the reference it started with (None without KL)."""
    if not cfg.train.kl_coef:
        return None
    if _reloadable(cfg):
        from gyre_jax.model.hf import load_pretrained

        mc = cfg.model
        _, params = load_pretrained(cfg.hf_path, mesh=mesh, dtype=mc.param_dtype,
                                    vocab_pad_multiple=mc.vocab_pad_multiple, max_seq_len=mc.max_seq_len)
        return _on_core(params, steps, mesh)
    path = os.path.join(workdir, REFERENCE_FILE)
    if not os.path.exists(path):
        raise RunFailed(f"config.train.kl_coef={cfg.train.kl_coef} but {path} is missing: this workdir's run started "
                        f"without the KL term, so its warm start was not kept; use a new --workdir (or kl_coef=0)")
    with np.load(path) as z:
        saved = dict(z)
    leaves, treedef = jax.tree_util.tree_flatten_with_path(steps.spec.abstract_params)
    names = [jax.tree_util.keystr(k) for k, _ in leaves]
    if sorted(names) != sorted(saved):
        raise RunFailed(f"{path} holds other parameters than the model's ({sorted(set(names) ^ set(saved))[:5]})")
    tree = jax.tree_util.tree_unflatten(treedef, [saved[n] for n in names])
    return _on_core(tree, steps, mesh)


def make_scorer(cfg, steps, mesh, ref_params) -> StepScorer:
    return StepScorer(steps, mesh, cfg.train, cfg.train.micro_batch_rows, ref_params=ref_params)


def describe(cfg, scorer: StepScorer, params) -> str:
    """One line: the objective, the per-step pass and its memory cost."""
    t = cfg.train
    one = params_bytes(params)
    kept = cfg.scheduler.staleness_bound if scorer.keeps_versions else 0
    parts = [f"loss={t.loss}", f"advantage={t.advantage}", f"weights={t.weights}", f"mismatch={t.mismatch}"]
    if t.kl_coef:
        parts.append(f"kl_coef={t.kl_coef} ({t.kl_estimator})")
    if t.dynamic_sampling:
        parts.append("dynamic_sampling")
    passes = sorted(scorer.passes & {"prox", "trainer", "ref"})
    mem = (f"reference params {one / 2**20:.1f} MiB" if t.kl_coef else "no reference")
    mem += f", behaviour versions kept: up to {kept} x {one / 2**20:.1f} MiB" if kept else ""
    return (f"rl: objective {' '.join(parts)}; per-step pass: {', '.join(passes) or 'none'} "
            f"(a forward per row each); memory: {mem}")
