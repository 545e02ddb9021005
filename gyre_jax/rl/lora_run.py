"""The RL loop's LoRA pieces (``--config.train.lora.rank=16``): the frozen base, the adapters' steps, resume.

A LoRA run trains adapters over a base it never changes (gyre_jax/model/lora.py,
gyre_jax/cells/frozen_base.py). What the loop holds as "params" everywhere (the train state,
checkpoints, satellites' snapshots, publications, role switches) is the tuple of adapters; the
base is made once, before the cells' steps are built:

* a fresh run makes it as a full run makes its starting params (``model.hf_path``'s weights or a
  random init, then the SFT warm start) and keeps it in ``<workdir>/lora_base/`` (params and a
  fingerprint), unless it is exactly ``model.hf_path``'s weights (no SFT): then the fingerprint
  alone is kept and a resume reloads the checkpoint;
* every checkpoint records the base's fingerprint (``meta["lora_base"]``), and a resume refuses a
  checkpoint whose adapters were trained on another base (a changed hf_path, another warm start).

The adapters start fresh (B = 0: the policy starts as the base exactly) or from a PEFT adapter
directory (``train.lora.init_from``); the KL reference, when there is one, is the starting
adapters, so KL is measured against the policy the RL started from.
"""
from __future__ import annotations

import functools
import json
import logging
import os
import tempfile
import time

import flax.serialization
import jax
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from gyre_jax import cells as cells_lib
from gyre_jax.cells.frozen_base import FrozenBase
from gyre_jax.cells.loss import policy_loss_fn
from gyre_jax.errors import ConfigError, RunFailed
from gyre_jax.losses import METRIC_REDUCTIONS
from gyre_jax.model import lora as lora_lib

log = logging.getLogger(__name__)
BASE_DIR = "lora_base"
_PARAMS, _META = "params.msgpack", "meta.json"
META_KEY = "lora_base"  # a checkpoint's meta: the fingerprint of the base its adapters were trained on


def _reloadable(cfg) -> bool:
    return bool(cfg.hf_path) and cfg.sft.steps == 0


def frozen_base(cfg, workdir: str, make_fresh) -> tuple[FrozenBase, list[dict]]:
    """The run's base (and the SFT history when it was made now): ``<workdir>/lora_base`` when an earlier
    attempt kept it, else ``make_fresh() -> (params, sft_history)``, kept for the next attempt."""
    pm = cfg.policy_model
    path = os.path.join(workdir, BASE_DIR)
    meta_path = os.path.join(path, _META)
    if os.path.isfile(meta_path):
        with open(meta_path) as f:
            meta = json.load(f)
        if meta.get("source") == "hf_path":
            params, _ = make_fresh()
        else:
            template = jax.eval_shape(functools.partial(_abstract_base, pm))
            with open(os.path.join(path, _PARAMS), "rb") as f:
                params = flax.serialization.from_bytes(jax.tree.map(lambda s: np.zeros(s.shape, s.dtype), template),
                                                       f.read())
        base = FrozenBase(pm, params)
        if base.fingerprint() != meta["fingerprint"]:
            raise RunFailed(f"{path} says the base has fingerprint {meta['fingerprint']}, but the base read now has "
                            f"{base.fingerprint()} ({'model.hf_path changed' if meta.get('source') == 'hf_path' else 'a damaged file'}); "
                            "use a new --workdir")
        log.info("rl: LoRA base read back from %s (%s)", path, meta.get("source"))
        return base, []
    params, history = make_fresh()
    base = FrozenBase(pm, params)
    if jax.process_index() == 0:
        _keep(path, base, reload=_reloadable(cfg))
    return base, history


def satellite_base(cfg, workdir: str, load_hf, *, timeout_s: float = 1800.0) -> FrozenBase:
    """A pods satellite's copy of the base: what the core keeps in ``<workdir>/lora_base`` (waited for: the core
    makes it, SFT included, while the satellites start), read from there or, when it is model.hf_path's weights,
    loaded from the checkpoint; the fingerprint must be the core's."""
    meta_path = os.path.join(workdir, BASE_DIR, _META)
    t0 = time.monotonic()
    while not os.path.isfile(meta_path):
        if time.monotonic() - t0 > timeout_s:
            raise RunFailed(f"{meta_path} did not appear within {timeout_s:.0f} s: a LoRA run's satellites read the "
                            "base the core keeps in its workdir (a filesystem every process sees)")
        time.sleep(1.0)
    base, _ = frozen_base(cfg, workdir, load_hf)
    print(f"pods satellite: LoRA base {base.fingerprint()} ({base.nbytes / 2**20:.1f} MiB) read from {workdir}", flush=True)
    return base


def _abstract_base(pm):
    from gyre_jax.cells.frozen_base import serving_dtype
    from gyre_jax.model import init_params

    return serving_dtype(init_params(pm.replace(lora=None), jax.random.key(0)), pm)


def _keep(path: str, base: FrozenBase, *, reload: bool) -> None:
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=".lora_base.", dir=os.path.dirname(path) or ".")
    if not reload:
        with open(os.path.join(tmp, _PARAMS), "wb") as f:
            f.write(flax.serialization.to_bytes(jax.device_get(base.params)))
    with open(os.path.join(tmp, _META), "w") as f:  # written last: its presence means the entry is whole
        json.dump({"fingerprint": base.fingerprint(), "source": "hf_path" if reload else "file",
                   "bytes": base.nbytes}, f)
    os.replace(tmp, path)
    log.info("rl: LoRA base kept in %s (%.1f MiB%s)", path, base.nbytes / 2**20, ", reloaded from model.hf_path"
             if reload else "")


def cell_steps(cfg, base: FrozenBase, loss_model) -> cells_lib.CellSteps:
    """The adapters' state spec (one adapter per task set, each its own optimizer state) and the jitted
    steps over the frozen base. ``loss_model``: the policy model as the loss runs it (parallelism, replay)."""
    pm = cfg.policy_model
    n = pm.lora.num_adapters
    opt = cfg.train  # the train section is the optimizer's config and the loss's
    tx = cells_lib.per_adapter(cells_lib.make_optimizer(opt, lora_lib.adapter_logical_axes(pm)), n)

    def init(rng):
        return tuple(lora_lib.init_adapter_boxed(pm, jax.random.fold_in(rng, a)) for a in range(n))

    spec = cells_lib.StateSpec.create(init, tx)
    return cells_lib.CellSteps(spec, policy_loss_fn(loss_model, cfg.train), cells_lib.make_schedule(opt),
                               reductions=METRIC_REDUCTIONS, base=base)


def initial_adapters(cfg, seed: int) -> tuple:
    """The adapters a fresh run starts from: ``train.lora.init_from``'s PEFT adapter (every adapter slot),
    else fresh ones (B = 0)."""
    pm = cfg.policy_model
    src = cfg.train.lora.init_from
    if not src:
        return lora_lib.init_adapters(pm, jax.random.key(seed))
    from gyre_jax.model.hf.peft import load_peft

    try:
        _, adapter = load_peft(src, pm)
    except (OSError, ValueError) as e:
        raise ConfigError(f"config.train.lora.init_from={src!r}: {e}") from None
    print(f"rl: LoRA adapters start from {src}", flush=True)
    return tuple(adapter for _ in range(pm.lora.num_adapters))


def check_resume(meta: dict, base: FrozenBase) -> None:
    """A checkpoint's adapters were trained on this base (ValueError otherwise: the loop skips to an older one
    or refuses)."""
    got = meta.get(META_KEY)
    if got is None:
        raise ValueError("the checkpoint holds a full model's state, not LoRA adapters (this workdir's run was not "
                         "a LoRA run): use a new --workdir")
    if got != base.fingerprint():
        raise ValueError(f"the checkpoint's adapters were trained on base {got}, this run's base is "
                         f"{base.fingerprint()}")


def merged(base: FrozenBase, adapters, index: int = 0) -> dict:
    """Adapter ``index`` folded into the base: the plain model's ``{"params": ...}`` (an eval, an HF export)."""
    return _merge_jit(base.config)(base.params, jax.device_put(adapters[index], _device_of(base.params)))


@functools.lru_cache(maxsize=8)
def _merge_jit(config):
    return jax.jit(lambda b, a: lora_lib.merge(config, b, a))


def _device_of(tree):
    """Where ``tree``'s first array lives, replicated (an adapter joins the base there for a merge)."""
    leaf = jax.tree.leaves(tree)[0]
    if not isinstance(leaf, jax.Array):
        return jax.devices()[0]
    sh = leaf.sharding
    return NamedSharding(sh.mesh, PartitionSpec()) if isinstance(sh, NamedSharding) else sh


def export_peft(cfg, adapters, workdir: str, version: int) -> list[str]:
    """Each adapter as a PEFT directory ``<workdir>/lora_export/adapter<a>`` (peft and vLLM load it on the base
    at model.hf_path); the paths. An adapter PEFT cannot take (MoE experts) is skipped with the reason."""
    from gyre_jax.model.hf.peft import save_peft

    out = []
    for a, adapter in enumerate(adapters):
        path = os.path.join(workdir, "lora_export", f"adapter{a}")
        try:
            save_peft(cfg.policy_model, adapter, path, base_model=cfg.hf_path)
        except ValueError as e:
            print(f"rl: LoRA adapter {a} not exported as PEFT: {e}", flush=True)
            continue
        with open(os.path.join(path, "gyre_version.txt"), "w") as f:
            f.write(f"{version}\n")
        out.append(path)
    if out:
        print(f"rl: exported policy version {version}'s LoRA adapters (PEFT) to {', '.join(out)}", flush=True)
    return out


class AdapterEvals:
    """Multi-LoRA's held-out eval: each adapter (merged into the base) on each adapter's task set, with the
    first-call eval of each set (``HeldOutEval``). The headline fields (``eval_reward`` ...) are the mean of
    each adapter on its own set; ``eval_adapter{a}_set{s}_reward`` each cell of the matrix, so a run shows
    each adapter moving on its own set and what it does to the others'."""

    def __init__(self, evals: list, base: FrozenBase):
        self.evals, self.base = list(evals), base

    def __call__(self, adapters) -> dict:
        out: dict = {}
        own = []
        for a in range(len(adapters)):
            params = merged(self.base, adapters, a)
            for s, ev in enumerate(self.evals):
                r = ev(params)
                out[f"eval_adapter{a}_set{s}_reward"] = r["eval_reward"]
                if a == s:
                    own.append(r)
        for k in ("eval_reward", "eval_exact", "eval_format"):
            out[k] = float(np.mean([r[k] for r in own]))
        out["eval_grader_errors"] = int(sum(r["eval_grader_errors"] for r in own))
        return out


def describe(cfg, base: FrozenBase, adapters) -> str:
    lora = cfg.lora
    ab = lora_lib.adapter_bytes(adapters)
    return (f"rl: LoRA rank={lora.rank} alpha={lora.alpha} ({lora.scale:g} x A@B) on {','.join(lora.targets)}"
            f"{' layers ' + ','.join(map(str, lora.layers)) if lora.layers else ''}, {lora.num_adapters} adapter(s): "
            f"{ab / 2**20:.2f} MiB trained, checkpointed and moved per switch vs the frozen base's "
            f"{base.nbytes / 2**20:.1f} MiB ({cfg.model.dtype}), served {cfg.train.lora.serving}")

