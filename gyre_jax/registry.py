"""One registry type for every extension point: a name -> an object, its typed options, a summary.

Every place a user picks something by name from a config (a policy loss, an advantage
estimator, a mismatch correction, a weight builder, a harness kind, a task family, a task
format, a metrics sink, a scheduling mode, a job) is a :class:`Registry`. An entry is the
registered object (a function, a class, an instance, or ``"module:attr"`` imported on first
use), the frozen dataclass of its options (``NoConfig`` when it has none; every field has a
default, so a config can list them for the command line), a one-line summary, its paper
where it comes from one, and kind-specific extras read as attributes (``entry.scope``).

Adding one is one definition and one registration beside it::

    @POLICY_LOSSES.register("my_loss", config=MyLossConfig, metrics={...}, summary="...", paper="...")
    def my_loss(x, cfg): ...

An unknown name is a ``LookupError`` that lists the known ones (``unknown policy loss 'x';
known: [...]``), the same for every registry; ``describe()`` is the listing (name, summary,
paper) that the README and ``python -m gyre_jax.plugins`` print.

Registries whose entries live in modules a process should not import until it needs them
(task families: a grader subprocess imports only its own family; harness kinds) name a
``package``: looking a name up imports ``<package>.<name>`` first, then, if the entry is still
unknown, every module of the package (each registers what it defines); ``names()`` imports the
whole package. Jobs register ``"module:function"`` strings (``register_lazy``), imported when run.
This module imports only the standard library (``import gyre_jax.losses`` stays light).
"""
from __future__ import annotations

import dataclasses
import importlib
import pkgutil
from typing import Any, Callable, Iterator, Mapping


@dataclasses.dataclass(frozen=True)
class NoConfig:
    """The options of an entry without any."""


def _defaults_ok(config: type) -> bool:
    return all(f.default is not dataclasses.MISSING or f.default_factory is not dataclasses.MISSING
               for f in dataclasses.fields(config) if f.init)


@dataclasses.dataclass(frozen=True)
class Entry:
    name: str
    target: Any  # the registered object, or "module:attr" (imported on first use: ``obj``)
    config: type  # frozen dataclass of its options; config() gives the defaults
    summary: str  # one line: what it is
    paper: str  # where it comes from ("" when nowhere in particular)
    extra: Mapping[str, Any]  # kind-specific attributes (a loss's metrics and inputs, a family's `generated`)

    def __getattr__(self, name):  # extra attributes read like fields: entry.inputs
        try:
            return self.__dict__["extra"][name]
        except KeyError:
            raise AttributeError(f"{self.name!r} ({type(self).__name__}) has no attribute {name!r}") from None

    @property
    def obj(self) -> Any:
        """The registered object (a lazy ``"module:attr"`` is imported here, once per process)."""
        if not isinstance(self.target, str):
            return self.target
        module, _, attr = self.target.partition(":")
        return getattr(importlib.import_module(module), attr)

    @property
    def fn(self) -> Callable:
        """``obj``, named for the registries of functions (losses, estimators, weight builders)."""
        return self.obj

    def options(self) -> tuple[str, ...]:
        return tuple(f.name for f in dataclasses.fields(self.config))

    def make_config(self, values: Mapping[str, Any] | None = None, *, where: str = ""):
        """The entry's options from ``values`` (missing fields: the defaults); an unknown field names the known."""
        values = dict(values or {})
        fields = set(self.options())
        unknown = sorted(set(values) - fields)
        if unknown:
            raise ValueError(f"{where}{unknown} do not apply to {self.name!r}; its options: {sorted(fields)}")
        return self.config(**values)

    def check_config(self, cfg, where: str = ""):
        """``cfg`` itself if it is this entry's options type, else a TypeError saying which it needs."""
        if type(cfg) is not self.config:
            raise TypeError(f"{where}{self.name!r} takes a {self.config.__name__}, got {type(cfg).__name__}")
        return cfg


class Registry:
    """name -> :class:`Entry` for one kind of thing (``kind`` names it in errors; ``flag`` is the config
    field that picks an entry; ``package``: where entries not yet registered are looked for)."""

    def __init__(self, kind: str, flag: str, *, package: str | None = None):
        self.kind, self.flag, self.package = kind, flag, package
        self._entries: dict[str, Entry] = {}
        self._scanned = False

    def register(self, name: str, *, config: type = NoConfig, summary: str, paper: str = "",
                 **extra) -> Callable[[Any], Any]:
        """Decorator (or call on an instance): register the object under ``name``; a duplicate is an error."""
        self._check(name, config)

        def add(obj: Any) -> Any:
            self._add(Entry(name=name, target=obj, config=config, summary=summary, paper=paper, extra=dict(extra)))
            return obj

        return add

    def register_lazy(self, name: str, target: str, *, summary: str, config: type = NoConfig, paper: str = "",
                      **extra) -> None:
        """Register ``"module:attr"``, imported only when the entry's ``obj`` is first asked for."""
        self._check(name, config)
        if not isinstance(target, str) or target.count(":") != 1:
            raise ValueError(f"{self.kind} {name!r}: a lazy target is 'module:attr', got {target!r}")
        self._add(Entry(name=name, target=target, config=config, summary=summary, paper=paper, extra=dict(extra)))

    def _check(self, name: str, config: type) -> None:
        if not isinstance(name, str) or not name.isidentifier():
            raise ValueError(f"{self.kind}: name must be an identifier, got {name!r}")
        # dataclasses has no public "is it frozen" query; __dataclass_params__ is what dataclass() sets.
        if not (dataclasses.is_dataclass(config) and config.__dataclass_params__.frozen):  # type: ignore[attr-defined]
            raise TypeError(f"{self.kind} {name!r}: config must be a frozen dataclass, got {config!r}")
        if not _defaults_ok(config):
            raise TypeError(f"{self.kind} {name!r}: every option of {config.__name__} needs a default (a config "
                            "lists them for the command line)")

    def _add(self, entry: Entry) -> None:
        if entry.name in self._entries:
            raise ValueError(f"{self.kind} {entry.name!r} is already registered")
        self.on_register(entry)
        self._entries[entry.name] = entry

    def on_register(self, entry: Entry) -> None:
        """A subclass's check or side effect before ``entry`` is added (raise to refuse it)."""

    def unregister(self, name: str) -> None:
        """Remove an entry (a test's own; nothing else should need this)."""
        self._entries.pop(name, None)

    def get(self, name: str) -> Entry:
        entry = self._entries.get(name) if isinstance(name, str) else None
        if entry is None and isinstance(name, str) and self.package is not None:
            self._discover(name)
            entry = self._entries.get(name)
        if entry is None:
            raise LookupError(f"unknown {self.kind} {name!r}; known: {self.names()}")
        return entry

    def _discover(self, name: str | None = None) -> None:
        """Import ``<package>.<name>``, then (if that did not register it) every module of the package."""
        assert self.package is not None
        if name is not None and name.isidentifier():
            module = f"{self.package}.{name}"
            try:
                importlib.import_module(module)
            except ModuleNotFoundError as e:
                if e.name != module:
                    raise
            if name in self._entries:
                return
        if not self._scanned:
            self._scanned = True
            pkg = importlib.import_module(self.package)
            for m in pkgutil.iter_modules(pkg.__path__):
                importlib.import_module(f"{self.package}.{m.name}")

    def names(self) -> list[str]:
        if self.package is not None:
            self._discover()
        return sorted(self._entries)

    def entries(self) -> Iterator[Entry]:
        """Every entry, sorted by name."""
        return (self._entries[n] for n in self.names())

    def __contains__(self, name) -> bool:
        try:
            self.get(name)
        except LookupError:
            return False
        return True

    def describe(self) -> list[tuple[str, str, str]]:
        """(name, summary, paper) per entry, sorted by name: the listing the README and the CLI print."""
        return [(e.name, e.summary, e.paper) for e in self.entries()]


# ------------------------------------------------------------------ a config's plugin options
OPTIONS_METADATA = "gyre_options"


@dataclasses.dataclass(frozen=True)
class OptionsSlot:
    """A config field holding the options of the entry (or entries) another field of the same config chooses."""

    source: Registry | Callable[[], Registry]  # the registry, or a function returning it (import order)
    selector: str  # the sibling field that names the chosen entry
    off: str | None = None  # a selector value that chooses no entry (the options are then None)
    multi: bool = False  # the selector names several entries, comma-separated; the options: name -> options

    @property
    def registry(self) -> Registry:
        return self.source if isinstance(self.source, Registry) else self.source()

    def chosen(self, selector_value: Any) -> list[str]:
        if self.multi:
            return [n.strip() for n in str(selector_value).split(",") if n.strip()]
        return [] if selector_value == self.off else [selector_value]


def options_field(source: Registry | Callable[[], Registry], selector: str, *, off: str | None = None,
                  multi: bool = False) -> Any:
    """A dataclass field for the options of the entry ``selector`` chooses: None (its defaults), a mapping of
    its fields, or its options instance; ``resolve_options`` (in ``__post_init__``) makes it the instance.

        loss: str = "ppo_clip"
        loss_options: Any = options_field(POLICY_LOSSES, "loss")   # --config.train.loss_options.ppo_clip.eps_low
    """
    return dataclasses.field(default=None, metadata={OPTIONS_METADATA: OptionsSlot(source, selector, off, multi)})


def options_slot(f: dataclasses.Field) -> OptionsSlot | None:
    return f.metadata.get(OPTIONS_METADATA)


def entry_options(entry: Entry, value: Any, where: str = ""):
    """``entry``'s options from None (its defaults), a mapping of its fields, or an instance (checked); an
    entry's ``check`` extra (e.g. "its package is installed") runs on the result."""
    if value is None:
        opts = entry.config()
    elif isinstance(value, Mapping):
        opts = entry.make_config(value, where=where)
    else:
        opts = entry.check_config(value, where)
    check = entry.extra.get("check")
    if check is not None:
        check(opts)
    return opts


def resolve_options(obj: Any) -> None:
    """For a frozen config's ``__post_init__``: each ``options_field`` becomes the chosen entry's options
    (a name -> options dict when ``multi``; None when the selector is ``off``); a ValueError names the field."""
    for f in dataclasses.fields(obj):
        slot = options_slot(f)
        if slot is None:
            continue
        names, value = slot.chosen(getattr(obj, slot.selector)), getattr(obj, f.name)
        where = f"{type(obj).__name__}.{f.name}: "
        registry = slot.registry
        unknown = [n for n in names if n not in registry]
        if unknown:
            known = ([slot.off] if slot.off is not None else []) + registry.names()
            raise LookupError(f"{type(obj).__name__}.{slot.selector}={getattr(obj, slot.selector)!r}: unknown "
                              f"{registry.kind} {unknown[0]!r}; known: {known}")
        if slot.multi:
            given = dict(value or {})
            stray = sorted(set(given) - set(names))
            if stray:
                raise ValueError(f"{where}options for {stray}, which {slot.selector}={getattr(obj, slot.selector)!r} "
                                 "does not name")
            out: Any = {n: entry_options(registry.get(n), given.get(n), where) for n in names}
        elif not names:
            if value is not None:
                raise ValueError(f"{where}is set but {slot.selector} is {slot.off!r}")
            out = None
        else:
            out = entry_options(registry.get(names[0]), value, where)
        object.__setattr__(obj, f.name, out)
