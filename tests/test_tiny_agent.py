"""The 'tiny_agent' family: multi-call episodes whose trees branch, an imperfect warm start by design.

Demonstrations run through the real agent loop, real tools and the real test-suite subprocess
(no waiting), with the harness knobs configs/learn.py ships; trees are rebuilt with the
trainer's own ``trajectory.tree``.
"""
import importlib.util
import os

import numpy as np
import pytest

from gyre_jax.agents.demos import demonstration
from gyre_jax.agents.tasks import make_task, tiny_agent
from gyre_jax.rl.config import RLConfig
from gyre_jax.rl.sft import _batch, demo_examples, demo_trees
from gyre_jax.serving.tokenizer import ByteTokenizer
from gyre_jax.trajectory.vocab import ROLE_MAIN, ROLE_SUBAGENT, ROLE_SUMMARY

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="module")
def learn_cfg():
    spec = importlib.util.spec_from_file_location("learn_config", os.path.join(ROOT, "configs", "learn.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return RLConfig.from_config(mod.get_config())


def _task(cfg, seed):
    return make_task("tiny_agent", seed, cfg.task.family_options, run_tests_scale=0.0)


def _task_with(cfg, strategy):
    return next(t for t in (_task(cfg, s) for s in range(200)) if tiny_agent.demo_strategy(t) == strategy)


@pytest.mark.parametrize("strategy,roles,score", [
    ("skip", (ROLE_MAIN, ROLE_MAIN), 0.5),
    ("test", (ROLE_MAIN, ROLE_MAIN, ROLE_SUMMARY, ROLE_MAIN), 1.0),
    ("delegate", (ROLE_MAIN, ROLE_MAIN, ROLE_SUBAGENT, ROLE_SUBAGENT, ROLE_SUMMARY, ROLE_MAIN), 1.0),
])
def test_demonstrations_read_test_compact_and_delegate_through_the_real_loop(learn_cfg, strategy, roles, score):
    hc = learn_cfg.harness
    task = _task_with(learn_cfg, strategy)
    demo = demonstration(task, hc, verify=True)
    assert tuple(c.role for c in demo.calls) == roles
    assert demo.score == score  # the real grader: an untested right answer earns half
    arg = task.setup_files[tiny_agent.INPUT_FILE]
    assert arg not in task.prompt  # the agent must read it: the second call sees it as a tool result
    assert arg in demo.calls[1].messages[-1]["content"]
    if strategy != "skip":  # the context that carried a test run outgrew the budget and was compacted
        after = demo.calls[-1].messages
        assert len(after) == 2 and hc.summary_header + "answer.txt written; 3 passed, 0 failed" in after[1]["content"]


def test_the_warm_start_tests_in_the_configured_fraction_of_demonstrations(learn_cfg):
    tasks = [_task(learn_cfg, s) for s in range(600)]
    strategies = [tiny_agent.demo_strategy(t) for t in tasks]
    tested = np.mean([s != "skip" for s in strategies])
    assert abs(tested - learn_cfg.task.family_options.demo_test_fraction) < 0.06
    assert 0.1 < np.mean([s == "delegate" for s in strategies]) < 0.2
    none = make_task("tiny_agent", 0, demo_test_fraction=0.0)
    assert tiny_agent.demo_strategy(none) == "skip"
    with pytest.raises(ValueError, match="demo_test_fraction"):
        make_task("tiny_agent", 0, demo_test_fraction=1.5)


def test_demo_trees_share_prefixes_and_train_every_target_once(learn_cfg):
    hc = learn_cfg.harness
    tok = ByteTokenizer()
    tasks = [_task_with(learn_cfg, s) for s in ("skip", "test", "delegate")]
    for task in tasks:
        [tree] = demo_trees([task], hc, tok)
        pairs = demo_examples([task], hc, tok)
        paths = [np.concatenate([n.tokens for n in p]) for p in tree.root_to_leaf_paths()]
        for prompt, target in pairs:  # every call's exact sequence is a prefix of some root-to-leaf path
            seq = np.concatenate([prompt, target])
            assert any(len(p) >= len(seq) and np.array_equal(p[:len(seq)], seq) for p in paths)
        trainable = sum(int(n.trainable.sum()) for n in tree.walk())
        assert trainable == sum(len(t) for _, t in pairs)
        expanded = sum(len(p) + len(t) for p, t in pairs)
        assert tree.num_tokens() < expanded if len(pairs) > 1 else tree.num_tokens() == expanded
    # a batch of trees: the packer splits a tree longer than a row; the targets stay whole
    trees = demo_trees(tasks, hc, tok)
    b, nxt = _batch(trees, np.arange(3), 0, rows=4, row_len=learn_cfg.train.row_len)
    assert nxt >= 3 and b["tokens"].shape == (4, learn_cfg.train.row_len)
    taken = [trees[k % 3] for k in range(nxt)]  # the order cycles when the rows have room
    assert int(b["loss_mask"].sum()) == sum(int(n.trainable.sum()) for t in taken for n in t.walk())


def test_a_max_tokens_that_cuts_a_demonstrated_reply_is_reported(learn_cfg, caplog):
    import dataclasses

    hc = dataclasses.replace(learn_cfg.harness, max_tokens=88)
    with caplog.at_level("WARNING", logger="gyre_jax.rl.sft"):  # a delegating reply is ~105 tokens
        demo_examples([_task_with(learn_cfg, "delegate")], hc, ByteTokenizer())
    assert "harness.max_tokens=88" in caplog.text and "call 1 (main)" in caplog.text
    caplog.clear()
    with caplog.at_level("WARNING", logger="gyre_jax.rl.sft"):
        demo_examples([_task_with(learn_cfg, "delegate")], learn_cfg.harness,
                      ByteTokenizer())
    assert "max_tokens" not in caplog.text
