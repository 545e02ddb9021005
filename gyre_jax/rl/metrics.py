"""Per-step metrics to a JSONL, TensorBoard event files and optionally Weights & Biases, from process 0 only.

``MetricsWriter(logdir).write(step, {"reward": 0.4, "failures": {"timeout": 2}})``
writes one JSONL line ``{"step": 3, "time": ..., "reward": 0.4, "failures/timeout": 2}``
and one TensorBoard scalar per number (nested dicts flatten to ``a/b`` tags, the
TensorBoard convention for grouping). Strings go to the JSONL and to TensorBoard
as text. A non-finite float (a NaN mean: no rollout of the step was scored) is written
to the JSONL as ``null``, because JSON has no NaN (Python's ``json`` wrote a bare ``NaN``
token that ``jq``, JavaScript and most JSON readers refuse); TensorBoard and W&B get the
NaN itself. Anything else (arrays, lists, None) is an error naming the key: a
metric is never dropped silently.

Why tensorboardX: it writes real TensorBoard event files (TFRecord framing,
``Event`` protos) with only numpy and protobuf, imports in ~0.4 s, and its
``purge_step`` is TensorBoard's own mechanism for hiding steps of a crashed run.
TensorFlow's ``tf.summary`` writes the same files but importing TensorFlow
costs seconds and gigabytes, and it is only present here as JetStream's
dependency.

Resume: pass ``purge_step=restored.step`` (the first step the resumed run will
write). TensorBoard then hides events of steps >= purge_step written by the
crashed attempt (a ``SessionLog.START`` at that step in the new event file), and
the JSONL is rewritten without its lines of those steps, which are moved to
``<name>.purged.jsonl``, so ``metrics.jsonl`` holds exactly one line per step of
the lineage whose params survived.

One interface: the JSONL is the record (resume purges it; tools read it back); every other
destination is a ``MetricSink`` in ``METRIC_SINKS`` (``gyre_jax/rl/sinks/``: ``tensorboard``, and
``wandb``, the ``wandb`` extra), fed the same validated, flattened dict:
``MetricsWriter(logdir, sinks={"tensorboard": None, "wandb": WandbOptions(mode="offline")})``.
W&B offline writes under ``<logdir>/wandb`` with no network (``wandb sync`` uploads it later).

Multi-host: only ``process_index == 0`` writes (default: ``jax.process_index()``);
the others validate their input the same way and write nothing.
"""
from __future__ import annotations

import dataclasses
import json
import math
import numbers
import os
import time
from typing import Any, ClassVar, Mapping, Protocol, TextIO

import numpy as np

from gyre_jax.registry import Registry, options_field, resolve_options

JSONL_NAME = "metrics.jsonl"
DEFAULT_SINKS: Mapping[str, Any] = {"tensorboard": None}


def flatten_metrics(metrics: Mapping[str, Any], prefix: str = "") -> dict[str, float | int | str]:
    """Nested dict -> {"a/b": scalar}; numpy / 0-d jax arrays -> Python scalars. Raises on anything else."""
    if not isinstance(metrics, Mapping):
        raise TypeError(f"metrics must be a dict, got {type(metrics).__name__}")
    out: dict[str, float | int | str] = {}
    for k, v in metrics.items():
        if not isinstance(k, str) or not k.strip("/") or k != k.strip("/"):
            raise ValueError(f"metric key {prefix + str(k)!r} must be a non-empty string not starting or ending with '/'")
        name = prefix + k
        if isinstance(v, Mapping):
            for kk, vv in flatten_metrics(v, name + "/").items():
                if kk in out:
                    raise ValueError(f"metric {kk!r} given twice (a flat key and a nested one)")
                out[kk] = vv
            continue
        if hasattr(v, "shape") and hasattr(v, "dtype"):  # numpy or jax array
            if tuple(v.shape) != ():
                raise ValueError(f"metric {name!r} must be a scalar, got an array of shape {tuple(v.shape)}")
            v = np.asarray(v).item()
        if isinstance(v, (bool, np.bool_)):
            v = int(v)
        elif isinstance(v, numbers.Integral):
            v = int(v)
        elif isinstance(v, numbers.Real):
            v = float(v)
        elif not isinstance(v, str):
            raise ValueError(f"metric {name!r}: expected a number, string or dict, got {type(v).__name__} {v!r:.80}")
        if name in out:
            raise ValueError(f"metric {name!r} given twice (a flat key and a nested one)")
        out[name] = v
    return out


class MetricsWriter:
    """One ``write(step, dict)`` per step; ``flush()`` and ``close()`` (see module docstring)."""

    def __init__(self, logdir: str, *, purge_step: int | None = None, process_index: int | None = None,
                 jsonl_name: str = JSONL_NAME, flush_secs: int = 30, sinks: Mapping[str, Any] | None = None,
                 run_config: Mapping[str, Any] | None = None):
        """``sinks``: METRIC_SINKS name -> its options (None: the defaults); unset: TensorBoard alone."""
        if process_index is None:
            import jax

            process_index = jax.process_index()
        if purge_step is not None and (not isinstance(purge_step, numbers.Integral) or purge_step < 0):
            raise ValueError(f"MetricsWriter: purge_step must be an int >= 0 or None, got {purge_step!r}")
        self.logdir = os.path.abspath(logdir)
        self.active = process_index == 0
        self.jsonl_path = os.path.join(self.logdir, jsonl_name)
        self.purged_path = os.path.splitext(self.jsonl_path)[0] + ".purged.jsonl"
        self._last_step: int | None = None
        self._closed = False
        self._sinks: list[MetricSink] = []
        self._jsonl: TextIO | None = None  # open exactly when active
        if not self.active:
            return
        os.makedirs(self.logdir, exist_ok=True)
        if purge_step is not None:
            self._last_step = self._purge_jsonl(int(purge_step))
        else:
            self._last_step = self._last_jsonl_step()
        self._jsonl = open(self.jsonl_path, "a", buffering=1)  # line-buffered: a crash loses at most a line
        context = SinkContext(self.logdir, purge_step, flush_secs, dict(run_config or {}))
        for name, options in (DEFAULT_SINKS if sinks is None else sinks).items():
            entry = METRIC_SINKS.get(name)
            options = entry.config() if options is None else entry.check_config(options, "metrics sink ")
            self._sinks.append(entry.obj(options, context))

    @property
    def last_step(self) -> int | None:
        """The newest step in the JSONL (after a purge: the newest kept); None if none."""
        return self._last_step

    def _read_jsonl(self) -> list[tuple[str, dict]]:
        if not os.path.exists(self.jsonl_path):
            return []
        out = []
        with open(self.jsonl_path) as f:
            for n, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    out.append((line, json.loads(line)))
                except json.JSONDecodeError:
                    if not line.endswith("\n"):  # a line cut by a crash: keep its text with the purged ones
                        out.append((line + "\n", {"step": math.inf, "torn_line": n}))
                        continue
                    raise ValueError(f"{self.jsonl_path}:{n}: not JSON: {line[:80]!r}") from None
        return out

    def _last_jsonl_step(self) -> int | None:
        steps = [d["step"] for _, d in self._read_jsonl() if isinstance(d.get("step"), int)]
        return max(steps) if steps else None

    def _purge_jsonl(self, purge_step: int) -> int | None:
        rows = self._read_jsonl()
        keep = [(ln, d) for ln, d in rows if d.get("step", math.inf) < purge_step]
        gone = [ln for ln, d in rows if not d.get("step", math.inf) < purge_step]
        if gone:
            with open(self.purged_path, "a") as f:
                f.writelines(gone)
            tmp = self.jsonl_path + f".tmp.{os.getpid()}"
            with open(tmp, "w") as f:
                f.writelines(ln for ln, _ in keep)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, self.jsonl_path)
        steps = [d["step"] for _, d in keep if isinstance(d.get("step"), int)]
        return max(steps) if steps else None

    def write(self, step: int, metrics: Mapping[str, Any], *, walltime: float | None = None) -> None:
        """Log ``metrics`` at ``step``; steps must increase (a repeated step would be ambiguous)."""
        if self._closed:
            raise RuntimeError(f"MetricsWriter({self.logdir}) is closed")
        if not isinstance(step, numbers.Integral) or isinstance(step, bool) or step < 0:
            raise ValueError(f"MetricsWriter.write: step must be an int >= 0, got {step!r}")
        step = int(step)
        flat = flatten_metrics(metrics)
        if "step" in flat or "time" in flat:
            raise ValueError("MetricsWriter.write: 'step' and 'time' are reserved metric names")
        if self._last_step is not None and step <= self._last_step:
            raise ValueError(f"MetricsWriter.write: step {step} after step {self._last_step}; steps must increase "
                             "(on resume, open the writer with purge_step=<first step to write>)")
        self._last_step = step
        if self._jsonl is None:  # not active
            return
        t = time.time() if walltime is None else float(walltime)
        line = {"step": step, "time": t, **{k: None if isinstance(v, float) and not math.isfinite(v) else v
                                             for k, v in flat.items()}}
        self._jsonl.write(json.dumps(line, allow_nan=False) + "\n")
        for sink in self._sinks:
            sink.write(step, flat, t)

    def flush(self) -> None:
        if self._jsonl is not None and not self._closed:
            for sink in self._sinks:
                sink.flush()
            self._jsonl.flush()
            os.fsync(self._jsonl.fileno())

    def close(self) -> None:
        if self._closed:
            return
        self.flush()
        self._closed = True
        if self._jsonl is not None:
            for sink in self._sinks:
                sink.close()
            self._jsonl.close()

    def __enter__(self) -> "MetricsWriter":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


# ------------------------------------------------------------------------------- sinks
# The JSONL is the record (it is what resume purges and what tools read back); every other
# destination is a MetricSink fed the same validated, flattened dict, registered by name in a module
# of gyre_jax/rl/sinks/ (``--config.metrics.sinks=tensorboard,wandb``).
METRIC_SINKS = Registry("metrics sink", "metrics.sinks", package="gyre_jax.rl.sinks")


class MetricSink(Protocol):
    def write(self, step: int, flat: Mapping[str, float | int | str], walltime: float) -> None: ...

    def flush(self) -> None: ...

    def close(self) -> None: ...


@dataclasses.dataclass(frozen=True)
class SinkContext:
    """What every sink is built with, besides its own options: ``Sink(options, context)``."""

    logdir: str
    purge_step: int | None  # resume: the first step this attempt writes (steps >= it of earlier attempts are void)
    flush_secs: int
    run_config: Mapping[str, Any] = dataclasses.field(default_factory=dict)  # the run's config, for sinks that show it


@dataclasses.dataclass(frozen=True, kw_only=True)
class MetricsConfig:
    """The RL run's metrics section (``config.metrics``): where per-step metrics go besides metrics.jsonl."""

    SECTION: ClassVar[str] = "metrics"
    MOVED: ClassVar[Mapping[str, str]] = {  # the flags this section had before its sinks were a registry
        "wandb": "now --config.metrics.sinks=tensorboard,wandb --config.metrics.sink_options.wandb.mode=offline",
        "wandb_project": "now --config.metrics.sink_options.wandb.project=NAME"}
    sinks: str = "tensorboard"  # comma-separated METRIC_SINKS: tensorboard, wandb (the wandb extra), ...
    sink_options: Any = options_field(METRIC_SINKS, "sinks", multi=True)  # --config.metrics.sink_options.NAME.X=v

    def __post_init__(self):
        names = [n.strip() for n in self.sinks.split(",") if n.strip()]
        if len(set(names)) != len(names):
            raise ValueError(f"MetricsConfig.sinks={self.sinks!r} names a sink twice")
        resolve_options(self)
