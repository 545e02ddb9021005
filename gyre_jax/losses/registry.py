"""Named registries with one shape: policy losses, mismatch corrections, advantage estimators, weight builders.

Every entry is a pure function plus a typed config (a frozen ``kw_only`` dataclass
that validates itself), the metrics it reports with how each combines over
micro-batches, a one-line summary and the paper it comes from. Adding one is one
function, one ``register`` call and its test; the RL loop, SFT and the offline tool
pick it by name (``--config.train.loss=NAME`` etc.), and an unknown name is a
``LookupError`` that lists the known ones.

Metric kinds: ``mean`` (a weighted sum ``sum(w * x)``: over a whole step, whose
weights sum to 1, the weighted mean), ``count`` (summed, never divided), ``min`` and
``max``. ``METRIC_REDUCTIONS`` is the union over every registered entry, so one
table combines any configuration's metrics; an entry that gives an existing metric
another kind is refused at registration.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Callable, Mapping

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


@dataclasses.dataclass(frozen=True)
class NoConfig:
    """The config of an entry without hyper-parameters."""


@dataclasses.dataclass(frozen=True)
class Entry:
    name: str
    fn: Callable
    config: type  # frozen kw_only dataclass; config() gives the paper's defaults
    metrics: Mapping[str, str]  # metric -> kind (METRIC_KINDS)
    summary: str  # one line: what it computes
    paper: str  # where it comes from
    extra: Mapping[str, Any]  # kind-specific attributes (e.g. the batch fields a loss reads)

    def __getattr__(self, name):  # extra attributes read like fields: entry.inputs
        try:
            return self.__dict__["extra"][name]
        except KeyError:
            raise AttributeError(f"{self.name!r} ({type(self).__name__}) has no attribute {name!r}") from None

    def make_config(self, values: Mapping[str, Any] | None = None, *, where: str = ""):
        """The entry's config from ``values`` (fields not given: the defaults); unknown fields name the known."""
        values = dict(values or {})
        fields = {f.name for f in dataclasses.fields(self.config)}
        unknown = sorted(set(values) - fields)
        if unknown:
            raise ValueError(f"{where}{unknown} do not apply to {self.name!r}; its fields: {sorted(fields)}")
        return self.config(**values)

    def check_config(self, cfg, where: str = ""):
        """``cfg`` itself if it is this entry's config type, else a TypeError saying which it needs."""
        if type(cfg) is not self.config:
            raise TypeError(f"{where}{self.name!r} takes a {self.config.__name__}, got {type(cfg).__name__}")
        return cfg


class Registry:
    """name -> Entry for one kind of function (``kind`` names it in errors)."""

    def __init__(self, kind: str, flag: str):
        self.kind = kind
        self.flag = flag  # the RL config field that picks an entry (for messages)
        self._entries: dict[str, Entry] = {}

    def register(self, name: str, *, config: type = NoConfig, metrics: Mapping[str, str] | None = None,
                 summary: str, paper: str, **extra) -> Callable[[Callable], Callable]:
        """Decorator: register ``fn`` under ``name`` (a duplicate name is an error)."""
        if not isinstance(name, str) or not name.isidentifier():
            raise ValueError(f"{self.kind}: name must be an identifier, got {name!r}")
        # dataclasses has no public "is it frozen" query; __dataclass_params__ is what dataclass() sets.
        if not (dataclasses.is_dataclass(config) and config.__dataclass_params__.frozen):  # type: ignore[attr-defined]
            raise TypeError(f"{self.kind} {name!r}: config must be a frozen dataclass, got {config!r}")
        metrics = dict(metrics or {})

        def add(fn: Callable) -> Callable:
            if name in self._entries:
                raise ValueError(f"{self.kind} {name!r} is already registered")
            declare_metrics(metrics, f"{self.kind} {name!r}")
            self._entries[name] = Entry(name=name, fn=fn, config=config, metrics=metrics, summary=summary,
                                        paper=paper, extra=extra)
            return fn

        return add

    def get(self, name: str) -> Entry:
        try:
            return self._entries[name]
        except (KeyError, TypeError):
            raise LookupError(f"unknown {self.kind} {name!r}; known: {self.names()}") from None

    def names(self) -> list[str]:
        return sorted(self._entries)

    def options(self) -> tuple[str, ...]:
        """Every field of every entry's config, sorted: the RL config has a ``train`` field of each name."""
        return tuple(sorted({f.name for e in self._entries.values() for f in dataclasses.fields(e.config)}))

    def __contains__(self, name) -> bool:
        return name in self._entries

    def describe(self) -> list[tuple[str, str, str]]:
        """(name, summary, paper) per entry, sorted by name: the README's list."""
        return [(n, self._entries[n].summary, self._entries[n].paper) for n in self.names()]


POLICY_LOSSES = Registry("policy loss", "train.loss")
MISMATCH_CORRECTIONS = Registry("mismatch correction", "train.mismatch")
ADVANTAGE_ESTIMATORS = Registry("advantage estimator", "train.advantage")
WEIGHT_BUILDERS = Registry("weight builder", "train.weights")
