"""One config schema: every shipped config's sections hold exactly the dataclasses' fields.

The dataclasses in gyre_jax/rl/config.py are the schema (types, validation, defaults); a
configs/*.py file lists every field so each can be overridden from the command line. A field
added to a dataclass but not to the demo (no --config override) or left in the demo after it
was removed from the dataclass (a silent no-op... now an error) fails here, naming it.
"""
import dataclasses
import importlib.util
import os

import pytest

from gyre_jax.rl import config as C
from gyre_jax.rl.config import RLConfig

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SECTIONS = {"cells": C.CellsConfig, "scheduler": C.SchedulerConfig, "task": C.TaskConfig, "harness": C.HarnessKnobs,
            "train": C.TrainConfig, "sft": C.SFTConfig, "eval": C.EvalConfig, "faults": C.FaultConfig,
            "metrics": C.MetricsConfig}


def _load(name):
    spec = importlib.util.spec_from_file_location(f"cfg_{name}", os.path.join(ROOT, "configs", name))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod.get_config()


@pytest.mark.parametrize("name", ["demo.py", "learn.py", "external.py"])
def test_shipped_rl_configs_list_every_field_of_every_section_and_nothing_else(name):
    c = _load(name).to_dict()
    for section, cls in SECTIONS.items():
        fields = {f.name for f in dataclasses.fields(cls)}
        have = set(c[section])
        assert not fields - have, f"configs/{name}: config.{section} lacks {sorted(fields - have)}"
        assert not have - fields, f"configs/{name}: config.{section} has unknown {sorted(have - fields)}"
    RLConfig.from_config(_load(name))  # and it validates


def _default(f):
    """A field's default as a config file writes it (a nested section, such as train.lora, as its dict)."""
    if f.default is not dataclasses.MISSING:
        d = f.default
    else:
        d = f.default_factory() if f.default_factory is not dataclasses.MISSING else dataclasses.MISSING
    return dataclasses.asdict(d) if dataclasses.is_dataclass(d) and not isinstance(d, type) else d


def test_the_dataclass_defaults_are_the_demos_values():
    """One set of defaults: a field left out of a config means what configs/demo.py ships."""
    c = _load("demo.py").to_dict()
    differ = [f"config.{name}.{f.name}: default {_default(f)!r}, demo {c[name][f.name]!r}"
              for name, cls in SECTIONS.items() for f in dataclasses.fields(cls) if _default(f) != c[name][f.name]]
    differ += [f"config.{f.name}: default {_default(f)!r}, demo {c[f.name]!r}" for f in dataclasses.fields(RLConfig)
               if f.name in c and f.name not in SECTIONS and f.name != "model" and _default(f) != c[f.name]]
    assert not differ, differ


@pytest.mark.parametrize("where, typo, hint", [("scheduler", "modee", "did you mean 'mode'?"),
                                               ("train", "learning_rat", "did you mean 'learning_rate'?"),
                                               ("", "stepz", "did you mean 'steps'?")])
def test_a_misspelled_field_names_the_nearest(where, typo, hint):
    d = _load("demo.py").to_dict()
    (d[where] if where else d)[typo] = 1
    with pytest.raises(C.ConfigError, match=rf"^config{'.' + where if where else ''}: unknown field\(s\) "
                                            rf"\['{typo}'\] \({hint.replace('?', '[?]')}\)"):
        RLConfig.from_config(d)


def test_routing_replay_needs_an_moe_model():
    d = _load("demo.py").to_dict()
    d["train"]["routing_replay"] = True
    with pytest.raises(C.ConfigError, match=r"config.train.routing_replay=True needs a mixture-of-experts model"):
        RLConfig.from_config(d)
    d["model"].update(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16)
    cfg = RLConfig.from_config(d)
    assert cfg.processor_config().routing_width == cfg.model.n_layers * 2  # rows carry every MoE layer's top-2


def test_every_option_of_every_registered_objective_entry_is_a_train_field():
    """A loss's (correction's, estimator's, weight builder's) option reaches its config only through the
    train field of the same name (one name from flag to field): an entry whose option has no field here
    could never be set, and the field must default to None (the chosen entry's own default)."""
    fields = {f.name: f for f in dataclasses.fields(C.TrainConfig)}
    assert C.entry_options(), "no options found: the check would pass vacuously"
    missing = [o for o in C.entry_options() if o not in fields]
    assert not missing, f"options of registered entries with no config.train field: {missing}"
    assert [o for o in C.entry_options() if fields[o].default is not None] == []


def test_each_objective_option_reaches_the_chosen_entry():
    d = _load("demo.py").to_dict()
    d["train"].update(loss="gspo", eps_low=1e-3, mismatch="icepop", mismatch_high=4.0, advantage="reinforce_pp",
                      advantage_eps=0.01, weights="constant", weights_normalizer=64)
    cfg = RLConfig.from_config(d)
    lc, pc = cfg.loss_config(), cfg.processor_config()
    assert (lc.objective.eps_low, lc.mismatch_config.mismatch_high) == (1e-3, 4.0)
    assert pc.advantage.estimator_config.advantage_eps == 0.01 and pc.weights_config.weights_normalizer == 64


def test_a_task_family_gets_the_task_fields_its_make_task_takes(monkeypatch):
    """Routed by make_task's keyword names: a family with options needs no branch in the config."""
    import types

    import gyre_jax.agents.tasks as tasks

    def make_task(seed, *, min_len=1, max_len=2, run_tests_scale=1.0):
        raise AssertionError("not called")

    toy = types.SimpleNamespace(FAMILY="toy", make_task=make_task)
    monkeypatch.setattr(tasks, "family", lambda name: toy if name == "toy" else pytest.fail(name))
    assert C.TaskConfig(family="toy", min_len=4, max_len=6, run_tests_scale=0.5).kwargs() == dict(
        min_len=4, max_len=6, run_tests_scale=0.5)
