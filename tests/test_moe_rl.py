"""One RL step of the demo on a tiny mixture-of-experts model, in the default run.

The real stack at its cheapest: one cell of the 8 test devices (colocate: it serves, then
trains), the byte tokenizer's short prompts (one prefill bucket), one step. The engine decodes
with the MoE block and records each sampled token's experts through the HTTP proxy into the
store, its experts split over the serving mesh's 'expert' axis; the train step dispatches over
the training mesh's 'expert' axis and replays that routing. tests/test_hf_moe.py's slow test runs the same through a Qwen3-MoE checkpoint, its
chat template and the HF export.
"""
from __future__ import annotations

import json
import os

import jax
import numpy as np
import pytest

from configs import demo as demo_config
from gyre_jax import jobs
from gyre_jax.errors import ConfigError
from gyre_jax.model import init_params
from gyre_jax.rl.config import RLConfig
from gyre_jax.trajectory.store import TrajectoryStore

MOE = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16, router_aux_loss_coef=0.01)


def moe_demo_config():
    c = demo_config.get_config()
    c.steps, c.progress, c.checkpoint_every, c.first_last = 1, False, 1, 1
    c.model.update(dict(d_model=32, n_layers=1, n_heads=2, n_kv_heads=1, head_dim=16, d_ff=64, max_seq_len=96, **MOE))
    # One cell of 8: training mesh fsdp=4 x expert=2 and serving mesh data=4 x expert=2 (the loss, prefill and
    # decode dispatch tokens to the experts all-to-all).
    c.cells.update(dict(cell_size=8, train_expert=2, serve_expert=2, max_slots=4, max_len=96))
    c.scheduler.update(dict(mode="colocate", groups_per_step=1, group_size=4, min_work_per_switch_s=0.0))
    # A loaded host compiles the engine's first prefill slowly: the deadline only bounds a hang.
    c.harness.update(dict(max_tokens=12, deadline_s=300.0, request_timeout_s=300.0))
    # A random model earns no reward, so every advantage is 0: the entropy bonus gives the experts a gradient.
    c.train.update(dict(row_len=96, micro_batch_rows=8, learning_rate=1e-2, routing_replay=True, entropy_coef=0.01))
    c.sft.steps = 0  # random init: the mechanics, not learning
    c.eval.every = 0
    return c


def _checkpoint_params(wd, step):
    """The params of a checkpoint as host arrays (laid out by its own metadata)."""
    import orbax.checkpoint as ocp

    path = os.path.join(wd, "checkpoints", str(step), "state")
    ck = ocp.StandardCheckpointer()
    meta = ck.metadata(path).item_metadata.tree
    return ck.restore(path, jax.tree.map(lambda m: np.empty(m.shape, m.dtype), meta))["params"]["params"]


def test_rl_step_on_a_tiny_moe_model_through_the_proxy(tmp_path):
    """The step's metrics, the records' routing, and the MoE params the step changed."""
    c = moe_demo_config()
    cfg = RLConfig.from_config(c)
    summary = jobs.get(c.job)(c, str(tmp_path))
    wd = os.path.join(tmp_path, "colocate")
    lines = [json.loads(x) for x in open(os.path.join(wd, "metrics.jsonl"))]
    assert [r["step"] for r in lines] == [0] and summary["statuses"] == {"completed": 4}, summary
    m = lines[0]
    # The load-balancing loss (E x sum_e f_e p_e: at least K = 2 for top-2) and the experts' load (E x max share).
    assert m["loss/moe_aux_loss"] >= 2.0 - 1e-5 and 1.0 <= m["loss/moe_max_load"] <= 4.0, m
    # Every trained token carried the experts the engine recorded through the proxy.
    with TrajectoryStore(os.path.join(wd, "store"), run_id="rl", writable=False) as store:
        calls = [x for r in store.rollout_ids() for x in store.calls(r)]
    assert len(calls) == 4
    for x in calls:
        assert x.output_routing is not None and x.output_routing.shape == (len(x.output_ids), 2)
    assert m["loss/routing_recorded_tokens"] == sum(len(x.output_ids) for x in calls) > 0, m
    assert 0.0 <= m["routing_mismatch"] <= 1.0, m
    # The step trained the MoE block: router, and the experts the replayed tokens went to.
    before = init_params(cfg.model, jax.random.key(cfg.warm_seed))["params"]["layers"]["moe"]
    after = _checkpoint_params(wd, 1)["layers"]["moe"]
    used = np.unique(np.concatenate([x.output_routing.reshape(-1) for x in calls]))
    assert float(np.abs(after["router"] - np.asarray(before["router"])).max()) > 1e-4
    for name in ("gate", "up", "down"):
        moved_E = np.abs(after[name] - np.asarray(before[name]))[0].reshape(4, -1).max(axis=1)
        assert (moved_E[used] > 1e-4).all(), (name, moved_E, used)


def test_expert_degrees_must_split_the_experts():
    for knob, degree in (("serve_expert", 8), ("train_expert", 8)):
        c = moe_demo_config()
        c.cells[knob] = degree
        with pytest.raises(ConfigError, match=f"config.cells.{knob}=8: model.num_experts=4 does not split evenly"):
            RLConfig.from_config(c)
    c = moe_demo_config()
    c.model.update(dict(num_experts=0, num_experts_per_tok=0, moe_intermediate_size=0, router_aux_loss_coef=0.0))
    c.train.routing_replay = False
    with pytest.raises(ConfigError, match=r"config.cells.train_expert=2 splits .* dense \(model.num_experts=0\)"):
        RLConfig.from_config(c)
