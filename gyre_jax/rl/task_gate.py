"""Every task's grader checked before training (``gyre_jax.agents.task_check``), from a config.

``check_command(config, workdir)`` is ``python -m launch.main --config ... --check_tasks``: every
task of the config's task file (train and eval), or a sample of a generated family's, checked
through the rollout sandbox and grader path; one line per task with its seconds, a progress line
with rate and ETA, a last line naming each broken task; returns the exit code (0: all good, 1:
some broken). ``gate(cfg, workdir)`` is the RL job's start (``config.task.check="start"``): the
same check for a task file, results of good tasks cached in ``<workdir>/task_check.json`` and in
the user's ``~/.cache/gyre_jax/task_check.json`` (``$GYRE_TASK_CHECK_CACHE``; "" turns it off), keyed
by the task's content and the grader environment: a resumed run, or a new run of the same task
file, does not check them again (384 tasks took ~7 minutes of a 2-core host's setup); a
broken task stops the run with one line naming it and why, or with
``config.task.skip_broken=True`` is dropped from the run (counted in the log and the summary).
"""
from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import os
import shutil
import sys
import time
from typing import Any

from gyre_jax.errors import ConfigError

log = logging.getLogger(__name__)
FAMILY_SAMPLES = 4  # tasks of a generated family --check_tasks checks (its graders are gyre's own)
CACHE_FILE = "task_check.json"
SHARED_CACHE = os.path.join(os.path.expanduser("~"), ".cache", "gyre_jax", CACHE_FILE)


def _harness_config(task, knobs):
    from gyre_jax.agents.config import HarnessConfig

    return HarnessConfig(base_url="http://127.0.0.1:1/v1", run_id="check", grader_timeout_s=knobs.grader_timeout_s,
                         grader_ro_paths=task.grader_ro_path_list, sandbox=knobs.sandbox)


def _tasks(source, *, family_samples: int) -> list:
    if hasattr(source, "all_tasks"):
        return source.all_tasks()
    return [source.train_task(i) for i in range(family_samples)] + source.eval_tasks(1)


def _sections(config: Any):
    """The config's task and harness sections alone (the rest of a run's config is not checked here)."""
    from gyre_jax.rl.config import RLConfig
    from gyre_jax.schema import from_mapping

    d = config.to_dict() if hasattr(config, "to_dict") else dict(config)
    base = RLConfig.defaults()
    task, harness = (from_mapping(type(getattr(base, name)), dict(d.get(name, {})), name, base=getattr(base, name))
                     for name in ("task", "harness"))
    return task, harness, int(d.get("seed", 0))


def _key(task, hc) -> str:
    """The task as graded (its JSON, its own tree's content: a plain repo directory edited since is
    checked again) and the grader environment."""
    from gyre_jax.agents.graded_tree import base_key

    env = [hc.sandbox.kind, list(hc.grader_ro_paths), sys.executable]
    return hashlib.sha256(json.dumps([task.to_json(), base_key(task), env]).encode()).hexdigest()[:32]


def run_checks(tasks: list, hc, root: str, *, concurrency: int, echo: bool) -> list:
    """Check ``tasks`` (printing each line as it completes when ``echo``), in a scratch ``root``."""
    from gyre_jax.agents.task_check import check_tasks

    def show(r) -> None:
        if echo:
            print(r.line(), flush=True)

    try:
        return asyncio.run(check_tasks(tasks, hc, root, concurrency=concurrency, on_result=show))
    finally:
        shutil.rmtree(root, ignore_errors=True)


def _concurrency() -> int:
    return max(1, min(8, os.cpu_count() or 1))


def check_command(config: Any, workdir: str) -> int:
    """``--check_tasks``: see the module docstring; the exit code."""
    from gyre_jax.agents.sandbox import resolve_kind

    task, knobs, seed = _sections(config)
    try:
        source = task.source(seed)
    except (ValueError, LookupError) as e:
        raise ConfigError(str(e)) from None
    hc = _harness_config(task, knobs)
    tasks = _tasks(source, family_samples=FAMILY_SAMPLES)
    print(f"check: {len(tasks)} tasks of {source.describe()}, sandbox {resolve_kind(hc.sandbox.kind)}, "
          f"{_concurrency()} at a time", flush=True)
    t0 = time.monotonic()
    results = run_checks(tasks, hc, os.path.join(workdir, "task_check"), concurrency=_concurrency(), echo=True)
    broken = [r for r in results if not r.ok]
    print(f"check: {len(results) - len(broken)} ok, {len(broken)} broken of {len(results)} tasks in "
          f"{time.monotonic() - t0:.1f} s" + (f"; broken: {', '.join(r.task_id for r in broken)}" if broken else ""),
          flush=True)
    return 1 if broken else 0


def gate(cfg, workdir: str) -> dict:
    """The RL job's check at start (module docstring); returns what it found for the summary."""
    if cfg.task.check == "off" or not cfg.task.dataset:
        return {}
    hc = _harness_config(cfg.task, cfg.harness)
    tasks = _tasks(cfg.task_source, family_samples=0)
    path = os.path.join(workdir, CACHE_FILE)
    shared = os.environ.get("GYRE_TASK_CHECK_CACHE", SHARED_CACHE)
    cache = _read_cache(path)
    known = {**_read_cache(shared), **cache} if shared else cache
    todo = [t for t in tasks if _key(t, hc) not in known]
    t0 = time.monotonic()
    if todo:
        log.info("task check: %d of %d tasks to check (%d known good)", len(todo), len(tasks), len(tasks) - len(todo))
        results = run_checks(todo, hc, os.path.join(workdir, "task_check"), concurrency=_concurrency(), echo=False)
    else:
        results = []
    broken = [r for r in results if not r.ok]
    good = {_key(t, hc): r.to_dict() for t, r in zip(todo, results) if r.ok}
    cache.update({k: known[k] for k in (_key(t, hc) for t in tasks) if k in known})
    cache.update(good)
    _write_cache(path, cache)
    if shared and good:
        try:  # re-read: another run may have added its own since
            _write_cache(shared, {**_read_cache(shared), **good})
        except OSError as e:
            log.info("task check: the shared cache %s was not written (%s)", shared, e)
    summary = {"tasks": len(tasks), "checked": len(results), "broken": [r.task_id for r in broken],
               "seconds": time.monotonic() - t0}
    if not broken:
        log.info("task check: %d tasks good (%.1f s)", len(tasks), summary["seconds"])
        return summary
    why = "; ".join(f"{r.task_id}: {r.problems[0]}" for r in broken[:5])[:1500]
    if not cfg.task.skip_broken:
        raise ConfigError(f"{len(broken)} of {len(tasks)} tasks of {cfg.task.dataset} have a broken grader ({why}"
                          f"{'; ...' if len(broken) > 5 else ''}): fix them (python -m launch.main --config ... "
                          "--check_tasks shows each), or set --config.task.skip_broken=True to train without them")
    cfg.task_source.exclude([r.task_id for r in broken])
    log.warning("task check: %d broken tasks skipped (config.task.skip_broken): %s", len(broken), why)
    return summary


def _read_cache(path: str) -> dict:
    try:
        with open(path) as f:
            data = json.load(f)
        return data if isinstance(data, dict) else {}
    except (OSError, ValueError):
        return {}


def _write_cache(path: str, cache: dict) -> None:
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    tmp = f"{path}.{os.getpid()}.tmp"  # runs sharing a cache file never write one temp file
    with open(tmp, "w") as f:
        json.dump(cache, f)
    os.replace(tmp, path)
