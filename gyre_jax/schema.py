"""Config sections: frozen ``kw_only`` dataclasses are the schema; this module turns them into the
ml_collections ConfigDict a ``configs/*.py`` file starts from, and that dict back into them.

A section is a dataclass whose fields are the knobs (type, default, a comment each); a field whose
default is a dataclass instance is a nested section (``config.model``, ``config.train.select``). A
plugin's options are an ``options_field`` (``gyre_jax.registry``): on the command line each entry of
the registry has its own sub-section of its typed options, and the entry the selector field chooses
is validated by its own schema (``--config.train.loss=gspo --config.train.loss_options.gspo.eps_low=3e-4``);
options of an entry not chosen must stay at their defaults. A ``derived`` field is set by the enclosing
config or at run time (``scheduler.total_steps`` is ``config.steps``), never on the command line.

``config_dict(section)`` lists every field with its value (None as a typed placeholder, so
``--config.a.b=v`` parses with the field's type); ``from_mapping(cls, mapping, where)`` builds the
section back, a misspelled field failing with the nearest name (``config.scheduler: unknown field(s)
['modee'] (did you mean 'mode'?)``), a bad value as a ``ConfigError`` that starts with its dotted name.
The flat spelling of an option (``train.eps_low``, ``task.ops``) still works: it is routed to the
entry its section chooses (``legacy_option``), and ``launch/cli_errors.py`` rewrites such a flag.
"""
from __future__ import annotations

import dataclasses
import difflib
import functools
import re
from typing import Any, Callable, Mapping

from gyre_jax.errors import ConfigError
from gyre_jax.registry import Registry, options_slot

DERIVED_METADATA = "gyre_derived"
FLAG_VIA_METADATA = "gyre_flag_via"


def derived(default: Any, by: str) -> Any:
    """A field the enclosing config (or the runner) sets from ``by``; not a command-line knob."""
    return dataclasses.field(default=default, metadata={DERIVED_METADATA: by})


def flag_via(path: str, default: Any) -> Any:
    """A field whose value is an object but whose flag is one scalar: ``path`` (dotted, from the section)
    reads it back for the command line (``harness.sandbox`` is a SandboxConfig, its flag the kind); the
    section's ``__post_init__`` turns the scalar into the object."""
    return dataclasses.field(default=default, metadata={FLAG_VIA_METADATA: path})


def _via(obj, path: str):
    for part in path.split("."):
        obj = getattr(obj, part)
    return obj


def knobs(cls_or_obj) -> list[dataclasses.Field]:
    """The fields a config file and the command line may set (init fields that are not derived)."""
    return [f for f in dataclasses.fields(cls_or_obj) if f.init and DERIVED_METADATA not in f.metadata]


# ---------------------------------------------------------------------------- checks
def check_positive(obj, names, *, allow_zero: bool = False) -> None:
    for n in names:
        v = getattr(obj, n)
        ok = v >= 0 if allow_zero else v > 0
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not ok:
            raise ConfigError(f"config.{obj.SECTION}.{n} must be {'>= 0' if allow_zero else '> 0'}, got {v!r}")


def check_ints(obj, names) -> None:
    for n in names:
        v = getattr(obj, n)
        if isinstance(v, bool) or not isinstance(v, int):
            raise ConfigError(f"config.{obj.SECTION}.{n} must be an int, got {v!r}")


def unknown_fields(where: str, unknown, known, hints: Mapping[str, str] | None = None) -> ConfigError:
    """The error for fields a section does not have, each with its nearest known field when one is close
    (``config.scheduler: unknown field(s) ['modee'] (did you mean 'mode'?)``); ``hints``: field -> where
    it lives now (an option of an entry the section does not choose)."""
    known = sorted(known)
    hints = dict(hints or {})
    near = {u: m[0] for u in unknown if u not in hints and (m := difflib.get_close_matches(u, known, n=1, cutoff=0.6))}
    if len(unknown) == 1 and near:
        extra = f" (did you mean {next(iter(near.values()))!r}?)"
    else:
        extra = f" (did you mean: {', '.join(f'{u!r} -> {m!r}' for u, m in near.items())})" if near else ""
    extra += "".join(f"; {u} is {h}" for u, h in sorted(hints.items()))
    listing = "" if set(unknown) <= set(hints) else f"; known: {known}"  # a hint says where each one lives
    return ConfigError(f"config{'.' + where if where else ''}: unknown field(s) {sorted(unknown)}{extra}{listing}")


def built(where: str, build: Callable[[], Any]):
    """``build()``, with any error re-raised as a ConfigError naming the config field.

    An owner's config names its own fields (``PolicyConfig.serve_reserve=2 ...``) and a knob has one
    name from flag to field, so the class is all that changes: ``config.scheduler.serve_reserve``.
    """
    try:
        return build()
    except ConfigError:
        raise
    except (ValueError, LookupError, TypeError) as e:
        msg = str(e).strip("'\"")
        named = re.sub(r"\b[A-Z]\w*(?:Config|Options)\.(?=\w)", f"config.{where}.", msg)
        raise ConfigError(named if named != msg else f"config.{where}: {msg}") from None


# ---------------------------------------------------------------------------- to the command line
_SCALARS = (("bool", bool), ("int", int), ("float", float), ("str", str))


def _annotated(f: dataclasses.Field) -> type | None:
    """The scalar type a field's annotation names (``float | None`` -> float), if one."""
    text = f.type if isinstance(f.type, str) else getattr(f.type, "__name__", str(f.type))
    for name, t in _SCALARS:
        if re.search(rf"\b{name}\b", text):
            return t
    return None


def _flag_value(f: dataclasses.Field, v: Any):
    from ml_collections import config_dict

    t = _annotated(f)
    if v is None:
        return config_dict.placeholder(t or str)
    if t is float and isinstance(v, int) and not isinstance(v, bool):
        return float(v)  # so --config.x=1.5 parses as a float
    if isinstance(v, Mapping):
        return config_dict.ConfigDict(dict(v))
    return v


def _options_dict(slot, obj: Any, name: str, base: Any) -> dict:
    chosen, value = slot.chosen(getattr(obj, slot.selector)), getattr(obj, name)
    out = {}
    for entry in slot.registry.entries():
        if not entry.options():
            continue
        if entry.name in chosen:
            opts = value if not slot.multi else value[entry.name]
        else:
            opts = _baseline(slot, entry, base, name)
        out[entry.name] = to_dict(opts)
    return out


def to_dict(obj, base: Any = None) -> dict:
    """Every knob of ``obj`` (a section instance) as nested plain values, typed placeholders for None; the
    options of entries ``obj`` does not choose are ``base``'s for them (the config it started from)."""
    out: dict[str, Any] = {}
    for f in knobs(obj):
        v = getattr(obj, f.name)
        slot = options_slot(f)
        if slot is not None:
            out[f.name] = _options_dict(slot, obj, f.name, base)
        elif FLAG_VIA_METADATA in f.metadata:
            out[f.name] = _flag_value(f, _via(obj, f.metadata[FLAG_VIA_METADATA]))
        elif dataclasses.is_dataclass(v) and not isinstance(v, type):
            out[f.name] = to_dict(v, getattr(base, f.name, None) if base is not None else None)
        else:
            out[f.name] = _flag_value(f, v)
    return out


def plain(obj) -> Any:
    """``obj`` (a config, nested) as plain JSON-able values: dataclasses and mappings as dicts, sequences as lists
    (what a sink shows as the run's config)."""
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return {f.name: plain(getattr(obj, f.name)) for f in dataclasses.fields(obj)}
    if isinstance(obj, Mapping):
        return {str(k): plain(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [plain(v) for v in obj]
    return obj


def config_dict(obj):
    """``obj``'s knobs as the ConfigDict a config file returns: every field, so each is a flag."""
    from ml_collections import config_dict as cd

    return cd.ConfigDict(to_dict(obj))


# ---------------------------------------------------------------------------- back from it
def _default_of(f: dataclasses.Field) -> Any:
    if f.default is not dataclasses.MISSING:
        return f.default
    return f.default_factory() if f.default_factory is not dataclasses.MISSING else dataclasses.MISSING


def _selector_value(cls_fields: Mapping[str, dataclasses.Field], value: Mapping, base: Any, selector: str):
    if selector in value:
        return value[selector]
    return getattr(base, selector) if base is not None else _default_of(cls_fields[selector])


def legacy_option(cls, value: Mapping, base: Any, key: str) -> tuple[str | None, list[str]]:
    """A field ``key`` a section does not have: the options field + entry of the chosen entry that has that
    option (``("loss_options", "ppo_clip")`` for ``train.eps_low``), and the other entries that have it."""
    fields = {f.name: f for f in dataclasses.fields(cls)}
    found, elsewhere = None, []
    for f in fields.values():
        slot = options_slot(f)
        if slot is None:
            continue
        chosen = slot.chosen(_selector_value(fields, value, base, slot.selector))
        for entry in slot.registry.entries():
            if key in entry.options():
                if entry.name in chosen and found is None:
                    found = f"{f.name}.{entry.name}"
                else:
                    elsewhere.append(f"{f.name}.{entry.name} ({slot.registry.kind} {entry.name!r}: "
                                     f"--config.{{where}}.{slot.selector}={entry.name})")
    return found, elsewhere


def _route_legacy(cls, value: dict, base: Any, known: set[str], where: str) -> dict[str, str]:
    """Move flat option keys into the chosen entry's sub-section; hints for those no chosen entry takes."""
    hints = {}
    for key in [k for k in value if k not in known]:
        found, elsewhere = legacy_option(cls, value, base, key)
        if found is None:
            if elsewhere:
                hints[key] = "an option of " + " or ".join(e.replace("{where}", where) for e in elsewhere)
            continue
        field, entry = found.split(".")
        opts = value.get(field)
        opts = dict(opts) if isinstance(opts, Mapping) else {}
        opts[entry] = {**dict(opts.get(entry, {})), key: value.pop(key)}
        value[field] = opts
    return hints


def _baseline(slot, entry, base: Any, name: str):
    """What the starting config holds for ``entry``'s options: its own, where it chose the entry; else the
    entry's defaults. Options that differ from it were set."""
    if base is not None and entry.name in slot.chosen(getattr(base, slot.selector)):
        value = getattr(base, name)
        return value[entry.name] if slot.multi else value
    return entry.config()


def _options_from_mapping(slot, name: str, selector_value: Any, given: Mapping, where: str, base: Any):
    """The chosen entry's options from ``{entry: {option: value}}``; options set for an entry the selector
    does not choose are an error naming both (they would do nothing)."""
    chosen = slot.chosen(selector_value)
    registry: Registry = slot.registry
    unknown = [n for n in chosen if n not in registry]
    if unknown:
        known = ([slot.off] if slot.off is not None else []) + registry.names()
        raise ConfigError(f"config.{where}.{slot.selector}={selector_value!r}: unknown {registry.kind} "
                          f"{unknown[0]!r}; known: {known}")
    for entry_name, opts in given.items():
        try:
            entry = registry.get(entry_name)
        except LookupError as e:
            raise ConfigError(f"config.{where}.{name}: {e}") from None
        if entry_name in chosen:
            continue
        start = _baseline(slot, entry, base, name)
        for k, v in dict(opts).items():
            if k not in entry.options() or v != getattr(start, k):
                raise ConfigError(f"config.{where}.{name}.{entry_name}.{k}={v!r} is set, but config.{where}."
                                  f"{slot.selector}={selector_value!r} does not choose {entry_name!r} (set "
                                  f"--config.{where}.{slot.selector}={entry_name}, or leave its options alone)")
    picked = {n: built(f"{where}.{name}.{n}", functools.partial(registry.get(n).make_config, dict(given.get(n, {}))))
              for n in chosen}
    if slot.multi:
        return picked
    return picked[chosen[0]] if chosen else None


def from_mapping(cls, value: Mapping[str, Any], where: str, base: Any = None):
    """The section ``cls`` from a mapping of its knobs (nested sections and options as mappings); fields not
    given keep ``base``'s values (the enclosing config's default for this section), else the class defaults."""
    value = dict(value)
    fields = {f.name: f for f in knobs(cls)}
    hints = _route_legacy(cls, value, base, set(fields), where)
    unknown = sorted(set(value) - set(fields))
    if unknown:
        hints.update({k: m for k, m in getattr(cls, "MOVED", {}).items() if k in unknown})
        raise unknown_fields(where, unknown, fields, hints)
    kw: dict[str, Any] = {}
    for name, v in value.items():
        f = fields[name]
        current = getattr(base, name) if base is not None else _default_of(f)
        slot = options_slot(f)
        if slot is not None and isinstance(v, Mapping):
            kw[name] = _options_from_mapping(slot, name, _selector_value(fields, value, base, slot.selector), v,
                                             where, base)
        elif (dataclasses.is_dataclass(current) and not isinstance(current, type) and isinstance(v, Mapping)
              and FLAG_VIA_METADATA not in f.metadata):
            kw[name] = from_mapping(type(current), v, f"{where}.{name}", base=current)
        else:
            kw[name] = v
    for f in fields.values():  # a new choice without its options: the new entry's defaults
        slot = options_slot(f)
        if slot is not None and slot.selector in value and f.name not in kw:
            kw[f.name] = None
    if base is not None:
        return built(where, lambda: dataclasses.replace(base, **kw))
    return built(where, lambda: cls(**kw))
