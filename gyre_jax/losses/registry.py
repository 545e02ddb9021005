"""The objective's four registries: policy losses, mismatch corrections, advantage estimators, weight builders.

They are ``gyre_jax.registry.Registry``s (the one registry type of the package): every entry is a
pure function plus a typed config (a frozen ``kw_only`` dataclass that validates itself), a
one-line summary and the paper it comes from; here each also declares the metrics it reports
with how each combines over micro-batches. Adding one is one function, one ``register`` call and
its test; the RL loop, SFT and the offline tool pick it by name (``--config.train.loss=NAME``,
its options ``--config.train.loss_options.NAME.OPTION=v``), and an unknown name is a
``LookupError`` that lists the known ones.

Metric kinds: ``mean`` (a weighted sum ``sum(w * x)``: over a whole step, whose
weights sum to 1, the weighted mean), ``count`` (summed, never divided), ``min`` and
``max``. ``METRIC_REDUCTIONS`` is the union over every registered entry, so one
table combines any configuration's metrics; an entry that gives an existing metric
another kind is refused at registration.
"""
from __future__ import annotations

from typing import Any, Callable, Mapping

from gyre_jax.registry import Entry, NoConfig, Registry

__all__ = ["ADVANTAGE_ESTIMATORS", "Entry", "METRIC_KINDS", "METRIC_REDUCTIONS", "MISMATCH_CORRECTIONS", "NOT_MEANS",
           "NoConfig", "ObjectiveRegistry", "POLICY_LOSSES", "Registry", "WEIGHT_BUILDERS", "declare_metrics"]

METRIC_KINDS = ("mean", "count", "min", "max")
_REDUCTION_OF_KIND = {"mean": "sum", "count": "sum", "min": "min", "max": "max"}

# metric -> "sum" | "min" | "max" over micro-batches (gyre_jax.cells.train_step reads it).
METRIC_REDUCTIONS: dict[str, str] = {}
# metrics that are not weighted means (mean_metrics leaves them alone)
NOT_MEANS: set[str] = set()


def declare_metrics(metrics: Mapping[str, str], where: str) -> None:
    """Add ``metrics`` (name -> kind) to the global reduction table; a kind conflict is an error."""
    for name, kind in metrics.items():
        if kind not in METRIC_KINDS:
            raise ValueError(f"{where}: metric {name!r} has kind {kind!r}; known: {METRIC_KINDS}")
        red = _REDUCTION_OF_KIND[kind]
        known = METRIC_REDUCTIONS.get(name)
        if known is not None and (known != red or (name in NOT_MEANS) != (kind != "mean")):
            raise ValueError(f"{where}: metric {name!r} is already declared with another kind")
        METRIC_REDUCTIONS[name] = red
        if kind != "mean":
            NOT_MEANS.add(name)


class ObjectiveRegistry(Registry):
    """The losses' registries: an entry declares its metrics (``metrics={name: kind}``) and its paper;
    a metric some other entry declared with another kind is refused at registration."""

    def register(self, name: str, *, config: type = NoConfig, summary: str, paper: str = "",
                 metrics: Mapping[str, str] | None = None, **extra) -> Callable[[Any], Any]:
        if not paper:
            raise ValueError(f"{self.kind} {name!r}: name the paper it comes from (paper=...)")
        return super().register(name, config=config, summary=summary, paper=paper, metrics=dict(metrics or {}),
                                **extra)

    def on_register(self, entry: Entry) -> None:
        declare_metrics(entry.metrics, f"{self.kind} {entry.name!r}")


POLICY_LOSSES = ObjectiveRegistry("policy loss", "train.loss")
MISMATCH_CORRECTIONS = ObjectiveRegistry("mismatch correction", "train.mismatch")
ADVANTAGE_ESTIMATORS = ObjectiveRegistry("advantage estimator", "train.advantage")
WEIGHT_BUILDERS = ObjectiveRegistry("weight builder", "train.weights")
