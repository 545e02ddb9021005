"""Weights & Biases (the ``wandb`` extra): ``--config.metrics.sinks=tensorboard,wandb``."""
from __future__ import annotations

import dataclasses
import importlib.util
import os
import time
from typing import Literal

from gyre_jax.errors import ConfigError
from gyre_jax.rl.metrics import METRIC_SINKS, SinkContext

WANDB_MODES = ("offline", "online")


@dataclasses.dataclass(frozen=True, kw_only=True)
class WandbOptions:
    """``--config.metrics.sink_options.wandb.*``."""

    mode: str = "offline"  # offline (files under <logdir>/wandb; `wandb sync` them later; no network) | online
    project: str = "gyre_jax"
    name: str = ""  # the run's display name ("" = the logdir's last two parts, e.g. gyre_demo/elastic)

    def __post_init__(self):
        if self.mode not in WANDB_MODES:
            raise ValueError(f"metrics.sink_options.wandb.mode={self.mode!r}; known: {WANDB_MODES}")


def _installed(options: WandbOptions) -> None:
    """Said at config time, before any work."""
    if importlib.util.find_spec("wandb") is None:
        raise ConfigError("config.metrics.sinks names wandb, which needs the wandb package: pip install -e '.[wandb]'")


@METRIC_SINKS.register("wandb", config=WandbOptions, check=_installed,
                       summary="a Weights & Biases run per attempt, grouped by the workdir (offline or online)")
class WandbSink:
    """A Weights & Biases run. Strings are logged as summary fields (W&B plots numbers only).

    Resume: W&B cannot hide steps a crashed attempt wrote, and drops a step lower than one it
    has seen, so every attempt is its own run in one W&B group (the workdir), its run id kept in
    ``<logdir>/wandb/attempts.txt``; the surviving lineage's steps are the last attempt's plus
    the earlier attempts' below its first step, as in metrics.jsonl.
    """

    def __init__(self, options: WandbOptions, context: SinkContext):
        try:
            import wandb
        except ImportError:
            raise ConfigError("metrics sink wandb needs the wandb package: pip install -e '.[wandb]'") from None
        logdir = context.logdir
        directory = os.path.join(logdir, "wandb")
        os.makedirs(directory, exist_ok=True)
        with open(os.path.join(directory, "attempts.txt"), "a+") as f:
            f.seek(0)
            attempt = sum(1 for line in f if line.strip())
            run_id = f"{os.getpid():x}{int(time.time() * 1e3):x}"[-16:]
            f.write(run_id + "\n")
        name = options.name or "/".join(logdir.rstrip("/").split("/")[-2:])
        mode: Literal["offline", "online"] = "offline" if options.mode == "offline" else "online"
        self._run = wandb.init(project=options.project, dir=directory, mode=mode, id=run_id,
                               name=name if attempt == 0 else f"{name} (attempt {attempt + 1})",
                               group=logdir, config=dict(context.run_config), reinit="create_new")

    def write(self, step, flat, walltime) -> None:
        numbers_ = {k: v for k, v in flat.items() if not isinstance(v, str)}
        self._run.log(numbers_, step=step)
        for k, v in flat.items():
            if isinstance(v, str):
                self._run.summary[k] = v

    def flush(self) -> None:
        pass  # the W&B service writes asynchronously; finish() in close() waits for it

    def close(self) -> None:
        self._run.finish()
