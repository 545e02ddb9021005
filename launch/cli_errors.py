"""One line for each way a command line can be wrong, before any JAX work.

``--config`` names a file that is missing or fails to load, a ``--config.a.b=v`` override
names a field the config does not have (the nearest existing name is suggested, or where a
field moved), or the workdir cannot be written. Each gives ``error: ...`` and exit code 2 within
seconds. A plugin option in its flat spelling (``--config.train.eps_low``, ``--config.task.ops``,
``--config.harness.command``) is respelled as the chosen entry's (``--config.train.loss_options.
ppo_clip.eps_low``), with a note.
"""
from __future__ import annotations

import difflib
import os
import runpy
import sys

from gyre_jax.errors import EXIT_CONFIG


def fail(message: str) -> None:
    print(f"error: {message}", file=sys.stderr, flush=True)
    sys.exit(EXIT_CONFIG)


def load_plain(path: str):
    """The config file's ``get_config()`` without overrides (to explain an override that failed)."""
    if not os.path.isfile(path):
        fail(f"--config={path}: no such file" + ("" if os.path.exists(path) else f" (cwd {os.getcwd()})"))
    try:
        return runpy.run_path(path)["get_config"]()
    except Exception as e:  # noqa: BLE001 - a broken config file: say where, once
        fail(f"--config={path}: loading it failed: {type(e).__name__}: {e}")


def nearest_field(typed: str, names) -> list[str]:
    """The field ``typed`` most likely meant, by spelling or by its initials (``lr``, ``lrr`` ->
    ``learning_rate``); [] when nothing is close."""
    def score(name: str) -> float:
        initials = "".join(w[:1] for w in name.split("_"))
        return max(difflib.SequenceMatcher(None, typed, name).ratio(),
                   difflib.SequenceMatcher(None, typed, initials).ratio() if "_" in name else 0.0)

    best = max(names, key=score, default=None)
    return [best] if best is not None and score(best) >= 0.3 else []


def _overrides(argv) -> dict[str, str]:
    """``--config.a.b=v`` flags as {"a.b": "v"} (a flag given as two words: the value is not needed here)."""
    out = {}
    for arg in argv:
        if arg.startswith("--config."):
            dotted, _, value = arg[len("--config."):].partition("=")
            out[dotted] = value
    return out


def _node(config, path: list[str]):
    for part in path:
        if not hasattr(config, "keys") or part not in config.keys():
            return None
        config = config[part]
    return config


def option_spelling(config, dotted: str, overrides: dict[str, str]) -> str | None:
    """The options sub-section path of a flat plugin option (``task.ops`` -> ``task.family_options.tiny.ops``):
    a field ``key`` of ``<section>.<selector>_options.<chosen entry>``, the entry as the argv or the config
    chooses it; None if no chosen entry has that option."""
    *parent, key = dotted.split(".")
    node = _node(config, parent)
    if node is None or not hasattr(node, "keys"):
        return None
    for name in node.keys():
        selector = name[: -len("_options")] if name.endswith("_options") else None
        if selector is None or selector not in node.keys():
            continue
        chosen = overrides.get(".".join(parent + [selector]), node[selector])
        for entry in str(chosen).split(","):
            opts = _node(node[name], [entry.strip()])
            if opts is not None and hasattr(opts, "keys") and key in opts.keys():
                return ".".join(parent + [name, entry.strip(), key])
    return None


def bad_override(config, argv) -> str | None:
    """The first ``--config.a.b=v`` of ``argv`` that names no field, with the nearest one; else None."""
    for dotted in _overrides(argv):
        node = config
        walked: list[str] = []
        for part in dotted.split("."):
            keys = list(node.keys()) if hasattr(node, "keys") else []
            if part not in keys:
                where = "config" + "".join("." + w for w in walked)
                moved = moved_flag(config, dotted) or option_elsewhere(config, dotted)
                if moved:
                    return f"--config.{dotted}: {where} has no field {part!r}; it is {moved}"
                near = nearest_field(part, keys)
                hint = (f"; did you mean {' or '.join(f'{where}.{n}' for n in near)}?" if near
                        else f"; {where} has {sorted(keys)}")
                return f"--config.{dotted}: {where} has no field {part!r}{hint}"
            node, walked = node[part], walked + [part]
    return None


def option_elsewhere(config, dotted: str) -> str | None:
    """A flat option no chosen entry has: the entries that have it, and how to choose one."""
    *parent, key = dotted.split(".")
    node = _node(config, parent)
    if node is None or not hasattr(node, "keys"):
        return None
    found = []
    for name in node.keys():
        selector = name[: -len("_options")] if name.endswith("_options") else None
        if selector is None or not hasattr(node[name], "keys"):
            continue
        found += [f"--config.{'.'.join(parent)}.{name}.{e}.{key} (with --config.{'.'.join(parent)}.{selector}={e})"
                  for e in node[name].keys() if hasattr(node[name][e], "keys") and key in node[name][e].keys()]
    return "an option of " + " or ".join(found) if found else None


def moved_flag(config, dotted: str) -> str | None:
    """Where a flag of an earlier schema went (an RL config's sections say: ``MOVED``)."""
    if _node(config, ["job"]) != "rl" or dotted.count(".") != 1:
        return None
    from gyre_jax.rl.config import RLConfig

    section, key = dotted.split(".")
    cls = type(getattr(RLConfig.defaults(), section, None))
    return getattr(cls, "MOVED", {}).get(key)


def respell(config, argv) -> tuple[list[str], list[str]]:
    """``argv`` with each flat plugin option spelled as its options sub-section (``--config.train.eps_low=0.3``
    -> ``--config.train.loss_options.ppo_clip.eps_low=0.3``: the spelling before plugins owned their options),
    and a note per flag respelled."""
    overrides = _overrides(argv)
    out, notes = [], []
    for arg in argv:
        if arg.startswith("--config."):
            dotted, eq, value = arg[len("--config."):].partition("=")
            new = None if _node(config, dotted.split(".")) is not None else option_spelling(config, dotted, overrides)
            if new is not None:
                notes.append(f"note: --config.{dotted} is --config.{new} (its entry's options)")
                arg = f"--config.{new}{eq}{value}"
        out.append(arg)
    return out, notes


def explain_config_failure(path: str | None, argv, error: BaseException) -> str:
    if path is None:
        return f"--config: {error}"
    config = load_plain(path)
    return bad_override(config, argv) or f"--config={path}: {type(error).__name__}: {error}"


def check_workdir(workdir: str) -> None:
    """The workdir is a directory we can write (created if missing)."""
    if os.path.exists(workdir) and not os.path.isdir(workdir):
        fail(f"--workdir={workdir}: exists and is not a directory")
    try:
        os.makedirs(workdir, exist_ok=True)
    except OSError as e:
        fail(f"--workdir={workdir}: cannot create it: {e.strerror}")
    if not os.access(workdir, os.W_OK | os.X_OK):
        fail(f"--workdir={workdir}: not writable by this user")


def config_path(argv) -> str | None:
    for i, arg in enumerate(argv):
        if arg.startswith("--config="):
            return arg.split("=", 1)[1]
        if arg == "--config" and i + 1 < len(argv):
            return argv[i + 1]
    return None


def precheck(argv) -> list[str]:
    """Before absl parses flags (its errors are tracebacks): the config file loads and every
    ``--config.*`` override names a field (a flat plugin option is respelled); the argv to parse."""
    path = config_path(argv)
    if path is None:
        return list(argv)  # absl says the flag is required, in one line
    config = load_plain(path)
    argv, notes = respell(config, argv)
    for note in notes:
        print(note, file=sys.stderr, flush=True)
    problem = bad_override(config, argv)
    if problem:
        fail(problem)
    return argv
