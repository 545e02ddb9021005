"""One line for each way a command line can be wrong, before any JAX work.

``--config`` names a file that is missing or fails to load, a ``--config.a.b=v`` override
names a field the config does not have (the nearest existing name is suggested), or the
workdir cannot be written. Each gives ``error: ...`` and exit code 2 within seconds.
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


def bad_override(config, argv) -> str | None:
    """The first ``--config.a.b=v`` of ``argv`` that names no field, with the nearest one; else None."""
    for arg in argv:
        if not arg.startswith("--config."):
            continue
        dotted = arg[len("--config."):].split("=", 1)[0]
        node = config
        walked: list[str] = []
        for part in dotted.split("."):
            keys = list(node.keys()) if hasattr(node, "keys") else []
            if part not in keys:
                where = "config" + "".join("." + w for w in walked)
                near = nearest_field(part, keys)
                hint = (f"; did you mean {' or '.join(f'{where}.{n}' for n in near)}?" if near
                        else f"; {where} has {sorted(keys)}")
                return f"--config.{dotted}: {where} has no field {part!r}{hint}"
            node, walked = node[part], walked + [part]
    return None


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


def precheck(argv) -> None:
    """Before absl parses flags (its errors are tracebacks): the config file loads and every
    ``--config.*`` override names a field."""
    path = config_path(argv)
    if path is None:
        return  # absl says the flag is required, in one line
    problem = bad_override(load_plain(path), argv)
    if problem:
        fail(problem)
