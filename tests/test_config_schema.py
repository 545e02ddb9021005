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
