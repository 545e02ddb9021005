"""LoRA in the RL loop (rl/lora_run.py): ``--config.train.lora.rank`` on the demo's tiny loop trains
adapters over a frozen base; checkpoints hold adapters and their optimizer state only, every weight
move is an adapter's bytes, the PEFT export at the end is the final adapter, and a resume onto
another base is refused."""
from __future__ import annotations

import json
import os

import jax
import numpy as np
import orbax.checkpoint as ocp
import pytest

from gyre_jax import jobs
from gyre_jax.errors import ConfigError
from gyre_jax.model import lora as L
from gyre_jax.rl.config import RLConfig
from tests.test_rl_loop import tiny_config


def lora_config(steps=2, rank=4, **over):
    c = tiny_config("elastic", steps=steps)
    c.train.lora.rank = rank
    c.train.lora.update(over)
    return c


def _leaf_paths(tree) -> list[str]:
    return [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_flatten_with_path(tree)[0]]


def test_lora_knobs_reach_the_model_and_bad_ones_fail_early():
    c = lora_config(rank=16, layers="0", targets="q_proj,v_proj", alpha=8.0)
    cfg = RLConfig.from_config(c)
    assert cfg.policy_model.lora == L.LoraConfig(rank=16, alpha=8.0, layers=(0,), targets=("q_proj", "v_proj"))
    assert cfg.model.lora is None  # the base's config stays the plain model's
    for field, value, match in (("targets", "qproj", "config.train.lora"), ("layers", "0-x", "config.train.lora.layers"),
                                ("layers", "5", "the model has 1 layers"), ("serve", "both", "serve must be one of")):
        bad = lora_config(**{field: value})
        with pytest.raises(ConfigError, match=match):
            RLConfig.from_config(bad)


def test_lora_loop_trains_and_moves_adapters_only(tmp_path):
    # 3 steps: step 2's groups must be sampled by version 1 or later (staleness bound 1), so some cell serves a
    # moved policy whatever the timing (in 2 steps every group may be sampled by version 0 and nothing moves).
    c = lora_config(steps=3)
    summary = jobs.get(c.job)(c, str(tmp_path))
    wd = os.path.join(tmp_path, "elastic")
    assert summary["steps"] == 3
    cfg = RLConfig.from_config(c)
    adapter_bytes = 4 * L.count_adapter_params(cfg.policy_model)
    lines = [json.loads(x) for x in open(os.path.join(wd, "metrics.jsonl"))]
    moves = sum(r["weight_moves"] for r in lines)
    assert moves > 0 and sum(r["weight_move_bytes"] for r in lines) == moves * adapter_bytes  # never the base
    # The checkpoint: the adapters and their Adam moments, nothing of the base.
    meta = ocp.StandardCheckpointer().metadata(os.path.join(wd, "checkpoints", "3", "state"))
    tree = meta.item_metadata if hasattr(meta, "item_metadata") else meta
    params = _leaf_paths(tree["params"])
    assert params and all("['lora']" in p for p in params), params[:5]
    moments = [p for p in _leaf_paths(tree["opt_state"]) if "mu" in p or "nu" in p]
    assert len(moments) == 2 * len(params) and all("['lora']" in p for p in moments)
    ck_meta = json.load(open(os.path.join(wd, "checkpoints", "3", "meta", "metadata")))
    base_meta = json.load(open(os.path.join(wd, "lora_base", "meta.json")))
    assert ck_meta["lora_base"] == base_meta["fingerprint"]
    # The PEFT export is the final checkpoint's adapter.
    from gyre_jax.model.hf.peft import load_peft

    _, exported = load_peft(os.path.join(wd, "lora_export", "adapter0"), cfg.policy_model)
    final = ocp.StandardCheckpointer().restore(os.path.join(wd, "checkpoints", "3", "state"))["params"]
    final = final[0] if isinstance(final, (list, tuple)) else final["0"]
    for (path, x), y in zip(jax.tree_util.tree_flatten_with_path(exported)[0], jax.tree.leaves(final)):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y), err_msg=jax.tree_util.keystr(path))


@pytest.mark.slow
def test_lora_resume_refuses_another_base(tmp_path):
    from gyre_jax.cells.frozen_base import FrozenBase
    from gyre_jax.model import init_params
    from gyre_jax.rl import lora_run

    c = lora_config(steps=1)
    jobs.get(c.job)(c, str(tmp_path))
    wd = os.path.join(tmp_path, "elastic")
    cfg = RLConfig.from_config(c)
    other = FrozenBase(cfg.policy_model, init_params(cfg.model, jax.random.key(123)))
    os.rename(os.path.join(wd, lora_run.BASE_DIR), os.path.join(wd, "old_base"))
    lora_run._keep(os.path.join(wd, lora_run.BASE_DIR), other, reload=False)
    c.steps = 2
    with pytest.raises(Exception, match="trained on base"):
        jobs.get(c.job)(c, str(tmp_path))


@pytest.mark.slow  # ~40 s idle, several minutes on a loaded 2-core host
def test_multi_lora_loop_routes_rollouts_to_their_adapters(tmp_path):
    """Two adapters over one base, each on its own task set: every call of group g's rollouts samples with
    adapter g % 2 (the proxy routes by the rollout's key), each adapter keeps its own optimizer state, both
    are exported, and the held-out eval scores each adapter on each set."""
    from gyre_jax.rl.build import build, jetstream_backend
    from gyre_jax.rl.loop import drive

    c = lora_config(adapters=2, adapter_tasks="ops=copy|ops=upper")
    c.task.ops = "copy,upper"
    c.eval = dict(kind="first_call", every=1, tasks=4, samples_per_task=2, temperature=1.0)
    seen = []

    def make_backend(cfg, cell, params, version, name, tok):
        b = jetstream_backend(cfg, cell, params, version, name, tok)
        submit = b.submit

        def recording(req):
            seen.append((req.cache_key, req.sampling.adapter, tok.decode(list(req.prompt_ids))))
            return submit(req)

        b.submit = recording
        return b

    cfg = RLConfig.from_config(c)
    drive(build(cfg, str(tmp_path), make_backend=make_backend))
    calls = [(k, a, p) for k, a, p in seen if k is not None]  # (the warm-up call has no rollout)
    assert len(calls) >= 16
    for key, adapter, prompt in calls:
        g = int(key.split("/")[1].split("-")[0][1:])
        assert adapter == g % 2, (key, adapter)
        assert ("\nupper " if adapter else "\ncopy ") in prompt  # each adapter's own task set
    meta = ocp.StandardCheckpointer().metadata(os.path.join(tmp_path, "checkpoints", "2", "state"))
    tree = meta.item_metadata if hasattr(meta, "item_metadata") else meta
    assert len(tree["params"]) == 2 and len(tree["opt_state"]) == 2  # one adapter and one optimizer state each
    for a in range(2):
        assert os.path.isfile(os.path.join(tmp_path, "lora_export", f"adapter{a}", "adapter_model.safetensors"))
    last = [json.loads(x) for x in open(os.path.join(tmp_path, "metrics.jsonl"))][-1]
    assert {f"eval/adapter{a}_set{s}_reward" for a in range(2) for s in range(2)} <= set(last)


@pytest.mark.slow  # two processes; ~2 min idle
def test_lora_pods_satellite_reads_the_base_and_moves_adapters_only(tmp_path):
    """The LoRA run across processes: the satellite process reads the frozen base the core keeps in the workdir,
    serves and trains on it, and every cross-process publication and snapshot is the adapters' bytes."""
    from tests.test_pods_rl import _launch

    workdir = str(tmp_path / "run")
    rc, out = _launch(workdir, steps=2, extra=["--config.train.lora.rank=4"])
    assert rc == 0, out[-6000:]
    assert "pods satellite: LoRA base" in out and "pods satellite 1: engine on cell 1 serving v0" in out, out[-4000:]
    import re

    run = os.path.join(workdir, "elastic")
    lines = [json.loads(x) for x in open(os.path.join(run, "metrics.jsonl"))]
    c = lora_config()
    c.model.update(dict(d_model=32, n_layers=1, n_heads=2, n_kv_heads=1, head_dim=16, d_ff=64, max_seq_len=96))
    adapter_bytes = 4 * L.count_adapter_params(RLConfig.from_config(c).policy_model)
    # The starting policy reached the satellite's engine as the adapters alone (the base was read from the workdir)
    published = re.search(r"rl: satellite 1 engine at \S+: v0 published \(([\d.]+) MB", out)
    assert published and float(published.group(1)) == round(adapter_bytes / 1e6, 2), out[-4000:]
    moves = sum(r["weight_moves"] for r in lines)  # later publications and switches (none if it only trained)
    assert sum(r["weight_move_bytes"] for r in lines) == moves * adapter_bytes
