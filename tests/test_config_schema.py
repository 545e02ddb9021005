"""One config schema: the dataclasses are it; config files start from ``rl_config()`` and list what differs.

Every knob of every section is a flag with its type (the ConfigDict is built from the dataclasses),
a config round-trips through its ConfigDict, a plugin's options are validated by the chosen entry's
own schema (and set for an entry not chosen, or misspelled, they fail naming the field), the flat
spelling of an option still reaches the chosen entry, and configs compose other configs' sections.
"""
import dataclasses
import os
import runpy

import pytest

from gyre_jax.errors import ConfigError
from gyre_jax.rl.config import RLConfig, load_config, rl_config
from gyre_jax.schema import knobs

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _load(name):
    return load_config(os.path.join(ROOT, "configs", name))


def _flags(obj, prefix=""):
    """Every flag a section's dataclass says it has (nested sections and options sub-sections aside)."""
    out = set()
    for f in knobs(obj):
        v = getattr(obj, f.name)
        if dataclasses.is_dataclass(v) and not isinstance(v, type) and "gyre_flag_via" not in f.metadata \
                and "gyre_options" not in f.metadata:
            out |= _flags(v, f"{prefix}{f.name}.")
        else:
            out.add(prefix + f.name)
    return out


def test_the_config_dict_is_built_from_the_dataclasses_and_round_trips():
    """rl_config() lists every knob (so each is a --config flag), and building it gives the defaults."""
    d = rl_config().to_dict()

    def has(path):
        node = d
        for part in path.split("."):
            if not isinstance(node, dict) or part not in node:
                return False
            node = node[part]
        return True

    flags = {f if not f.startswith(("hf_path", "hf_export", "chat_template_kwargs")) else "model." + f
             for f in _flags(RLConfig.defaults())}
    assert len(flags) > 100 and not [f for f in flags if not has(f)], sorted(f for f in flags if not has(f))
    assert RLConfig.from_config(rl_config()) == RLConfig()
    learn = RLConfig.from_config(_load("learn.py"))
    assert RLConfig.from_config(learn.to_config_dict()) == learn  # a config's dict builds the same config


def test_every_option_of_every_entry_is_a_typed_flag():
    d = rl_config().to_dict()
    assert d["train"]["loss_options"]["gspo"] == {"eps_low": 3e-4, "eps_high": 4e-4}
    assert d["train"]["mismatch_options"]["tis"] == {"mismatch_cap": 2.0}
    assert set(d["harness"]["kind_options"]["command"]) >= {"command", "env", "ro_paths", "memory_bytes"}
    assert d["task"]["family_options"]["tiny"] == {"ops": "copy", "min_len": 3, "max_len": 3}  # the demo's
    assert d["task"]["family_options"]["tiny_agent"]["demo_test_fraction"] == 0.3
    c = rl_config()
    assert c.train.loss_options.ppo_clip.get_type("clip_c") is float  # None (the entry's own) is a typed flag
    assert c.scheduler.get_type("min_work_per_switch_s") is float


@pytest.mark.parametrize("name", ["demo.py", "learn.py", "external.py"])
def test_shipped_rl_configs_validate(name):
    RLConfig.from_config(_load(name))


@pytest.mark.parametrize("where, typo, hint", [("scheduler", "modee", "did you mean 'mode'?"),
                                               ("train", "learning_rat", "did you mean 'learning_rate'?"),
                                               ("", "stepz", "did you mean 'steps'?")])
def test_a_misspelled_field_names_the_nearest(where, typo, hint):
    d = _load("demo.py").to_dict()
    (d[where] if where else d)[typo] = 1
    with pytest.raises(ConfigError, match=rf"^config{'.' + where if where else ''}: unknown field\(s\) "
                                          rf"\['{typo}'\] \({hint.replace('?', '[?]')}\)"):
        RLConfig.from_config(d)


def test_routing_replay_needs_an_moe_model():
    d = _load("demo.py").to_dict()
    d["train"]["routing_replay"] = True
    with pytest.raises(ConfigError, match=r"config.train.routing_replay=True needs a mixture-of-experts model"):
        RLConfig.from_config(d)
    d["model"].update(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16)
    cfg = RLConfig.from_config(d)
    assert cfg.train.routing_width == cfg.model.n_layers * 2  # rows carry every MoE layer's top-2


def test_each_objective_option_reaches_the_chosen_entry_in_either_spelling():
    d = _load("demo.py").to_dict()
    t = d["train"]
    t.update(loss="gspo", mismatch="icepop", advantage="reinforce_pp", weights="constant")
    t["loss_options"]["gspo"]["eps_low"] = 1e-3
    t["mismatch_options"]["icepop"]["mismatch_high"] = 4.0
    t.update(advantage_eps=0.01, weights_normalizer=64)  # the flat spelling: routed to the chosen entries
    cfg = RLConfig.from_config(d)
    tc = cfg.train  # the optimizer's, the loss's and the processor's config at once
    assert (tc.loss_options.eps_low, tc.mismatch_options.mismatch_high) == (1e-3, 4.0)
    assert tc.advantage_options.advantage_eps == 0.01 and tc.weights_options.weights_normalizer == 64


def test_an_option_of_an_entry_the_config_does_not_choose_is_an_error_naming_both():
    d = _load("demo.py").to_dict()
    d["train"]["loss_options"]["gspo"]["eps_low"] = 1e-3  # but loss stays ppo_clip
    with pytest.raises(ConfigError, match=r"config.train.loss_options.gspo.eps_low=0.001 is set, but "
                                          r"config.train.loss='ppo_clip' does not choose 'gspo'"):
        RLConfig.from_config(d)
    d = _load("demo.py").to_dict()
    d["train"]["is_cap"] = 2.0  # reinforce's, flat, with loss=ppo_clip
    with pytest.raises(ConfigError, match=r"unknown field\(s\) \['is_cap'\]; is_cap is an option of "
                                          r"loss_options.reinforce \(policy loss 'reinforce': "
                                          r"--config.train.loss=reinforce\)"):
        RLConfig.from_config(d)


def test_a_plugins_options_come_from_its_own_schema():
    """A task family, a harness kind, a metrics sink: each validates its own options, no other section's."""
    d = _load("demo.py").to_dict()
    d["task"].update(family="tiny_tests", run_tests_scale=0.5, max_len=4)
    d["harness"].update(kind="python", entry="gyre_jax.testing.scripted_harnesses:answer_once")
    d["eval"]["kind"] = "episodes"
    cfg = RLConfig.from_config(d)
    o = cfg.task.family_options
    assert (type(o).__module__, o.run_tests_scale, o.max_len) == ("gyre_jax.agents.tasks.tiny_tests", 0.5, 4)
    assert cfg.task_source.train_task(0).params["test_s"] <= 15.0
    assert cfg.harness.kind_options.entry == "gyre_jax.testing.scripted_harnesses:answer_once"
    d["harness"]["kind_options"] = {"python": {"entry": "x:y", "command": "ls"}}
    with pytest.raises(ConfigError, match=r"config.harness.kind_options.python: \['command'\] do not apply to "
                                          r"'python'; its options: \['entry'\]"):
        RLConfig.from_config(d)
    d = _load("demo.py").to_dict()
    d["metrics"]["wandb"] = "offline"
    with pytest.raises(ConfigError, match=r"unknown field\(s\) \['wandb'\].*wandb is now "
                                          r"--config.metrics.sinks=tensorboard,wandb"):
        RLConfig.from_config(d)


def test_configs_compose_and_a_checkpoint_goes_on_external(tmp_path):
    """external.py takes --config.model.hf_path (every config has every field), and a config of a few lines
    takes a checkpoint config's sections: built on a tiny checkpoint, its shape is the checkpoint's."""
    from gyre_jax.testing.tiny_hf_checkpoint import write_tiny_hf_checkpoint
    from gyre_jax.testing.tiny_hf_tokenizer import write_tiny_hf_tokenizer

    n = write_tiny_hf_tokenizer(str(tmp_path), "qwen3")
    write_tiny_hf_checkpoint(str(tmp_path), "qwen3", vocab_size=n + 1, seed=1)
    c = _load("external.py")
    c.model.hf_path = str(tmp_path)
    cfg = RLConfig.from_config(c)
    assert (cfg.hf_path, cfg.model.max_seq_len, cfg.harness.kind) == (str(tmp_path), 2048, "command")
    assert cfg.model.vocab_size >= n + 1 and cfg.model.qk_norm  # Qwen3's, from its config.json
    composed = runpy.run_path(os.path.join(ROOT, "configs", "external_qwen3_8b.py"))["get_config"]()
    with pytest.raises(ConfigError, match=r"config.model.hf_path is required by this config"):
        RLConfig.from_config(composed)
    composed.model.hf_path = str(tmp_path)
    composed.update(dict(steps=1))
    composed.cells.update(dict(max_len=768, max_slots=4, serve_tensor=2))  # the tiny checkpoint has 2 kv heads
    composed.model.max_seq_len = 768
    composed.train.update(dict(row_len=768))
    composed.harness.max_tokens = 96
    cfg = RLConfig.from_config(composed)
    assert (cfg.cells.cell_size, cfg.train.learning_rate, cfg.hf_export) == (4, 1e-6, True)  # qwen3_8b's
    assert (cfg.harness.kind, cfg.task.dataset.endswith("tasks.jsonl")) == ("command", True)  # external's


def test_the_command_line_respells_a_flat_option_and_names_a_moved_flag():
    from launch import cli_errors

    config = _load("external.py")
    argv, notes = cli_errors.respell(config, ["--config.harness.command=ls", "--config.train.eps_low=0.3",
                                              "--config.task.format=jsonl"])
    assert argv == ["--config.harness.kind_options.command.command=ls",
                    "--config.train.loss_options.ppo_clip.eps_low=0.3", "--config.task.format=jsonl"]
    assert len(notes) == 2
    assert "it is now --config.metrics.sinks" in cli_errors.bad_override(config, ["--config.metrics.wandb=online"])


def test_the_train_sections_owners_share_no_attribute():
    """TrainConfig is the optimizer's, the loss's and the processor's config at once: a method or property two of
    them define would silently be one of theirs for the other (the advantage estimator read as the policy loss)."""
    from gyre_jax.rl.train_config import TrainConfig

    owners = [c for c in TrainConfig.__mro__[1:] if dataclasses.is_dataclass(c)]
    assert len(owners) >= 4, owners

    def own(c):
        return {k for k in vars(c) if not k.startswith("__")} - {f.name for f in dataclasses.fields(c)}

    clashes = {(a.__name__, b.__name__): own(a) & own(b) for i, a in enumerate(owners) for b in owners[i + 1:]}
    assert not {k: v for k, v in clashes.items() if v}, clashes
    t = TrainConfig(advantage="rloo", loss="gspo")
    assert (t.estimator.name, t.entry.name) == ("rloo", "gspo")
