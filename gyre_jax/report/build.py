"""Build a run's report: ``build_report(mode_dir) -> stats``; the page and its data land in ``<mode_dir>/report``.

Layout (everything opens from disk, no server; the page loads its data with ``<script>`` tags, which a
browser allows for ``file://`` pages where ``fetch`` is refused)::

    report/index.html                the viewer (report/static/viewer.*)
    report/assets/                   plotly.js (basic bundle, MIT, vendored) and its license
    report/data/run.js               curves, evals, per-task and per-step tables, the role timeline
    report/data/index.js             one row per rollout (the table, search and filters)
    report/data/rollouts/<group>.js  each group's rollouts in full: calls, tree, decoded text, grader
                                     output, logs; loaded when a rollout is opened
    report/data/manifest.json        what each group file was built from (a rebuild redoes only the
                                     groups whose rollouts changed: new, finished or trained since)

A run that is still writing can be reported any number of times (the store is read with its
read-only reader, which tails a log another process appends to); a rebuild costs the new rollouts.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import re
import shutil
import time
from typing import Any, Mapping, Sequence

from gyre_jax.report import rollouts as rl_lib
from gyre_jax.report import run_data
from gyre_jax.report.decode import TurnDecoder
from gyre_jax.trajectory.rewards import AdvantageConfig
from gyre_jax.trajectory.select import SelectConfig


def _code_version() -> str:
    """The rollout files' format is the code that writes them: a changed decoder or detail rebuilds every group."""
    h = hashlib.sha1()
    for name in ("rollouts.py", "decode.py"):
        with open(os.path.join(os.path.dirname(os.path.abspath(__file__)), name), "rb") as f:
            h.update(f.read())
    return h.hexdigest()[:12]


FORMAT = _code_version()
STATIC = os.path.join(os.path.dirname(os.path.abspath(__file__)), "static")
ASSETS = ("plotly-basic.min.js", "LICENSE.plotly.txt")
_SAFE = re.compile(r"[^A-Za-z0-9_.-]")


@dataclasses.dataclass(frozen=True, kw_only=True)
class ReportSettings:
    """What the report needs of the run's config (``report.job`` builds it from the config the run used)."""

    tokenizer: str = "byte"  # the run's tokenizer: "byte" (the built-in one) or "hf:<checkpoint dir>"
    template_kwargs: Mapping[str, Any] = dataclasses.field(default_factory=dict)  # its chat template's variables
    select: SelectConfig = SelectConfig()
    advantage: AdvantageConfig = AdvantageConfig()
    group_field: str = "group_id"
    staleness_bound: int | None = None
    title: str = ""

    def key(self) -> str:
        return hashlib.sha1(repr((FORMAT, self.tokenizer, sorted(self.template_kwargs.items()), self.select,
                                  self.advantage, self.group_field)).encode()).hexdigest()[:16]

    def make_tokenizer(self):
        from gyre_jax.serving.tokenizer import load_tokenizer

        return load_tokenizer(self.tokenizer, template_kwargs=dict(self.template_kwargs) or None)


def mode_dirs(workdir: str) -> list[str]:
    """The run directories under ``workdir``: itself if it holds a store (``store/``, or is a bare store),
    else each ``<workdir>/<mode>`` that does."""
    def is_run(d):
        return os.path.exists(os.path.join(d, "store", "meta.json")) or os.path.exists(os.path.join(d, "meta.json")) \
            or os.path.exists(os.path.join(d, "metrics.jsonl"))

    if is_run(workdir):
        return [workdir]
    if not os.path.isdir(workdir):
        return []
    return [os.path.join(workdir, n) for n in sorted(os.listdir(workdir)) if is_run(os.path.join(workdir, n))]


def _store_dir(mode_dir: str) -> str | None:
    for d in (os.path.join(mode_dir, "store"), mode_dir):
        if os.path.exists(os.path.join(d, "meta.json")):
            return d
    return None


def _shard(group: str) -> str:
    safe = _SAFE.sub("_", group)[:80]
    return safe if safe == group else f"{safe}-{hashlib.sha1(group.encode()).hexdigest()[:8]}"


def _write_js(path: str, var_or_call: str, obj, call: bool = False) -> int:
    try:
        text = json.dumps(obj, separators=(",", ":"), allow_nan=False, default=_jsonable)
    except ValueError:  # a NaN somewhere (rare: the records are JSON-clean): walk it once
        text = json.dumps(_clean(obj), separators=(",", ":"), allow_nan=False, default=_jsonable)
    body = f"{var_or_call}({text});\n" if call else f"{var_or_call} = {text};\n"
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        f.write(body)
    os.replace(tmp, path)
    return len(body)


def _jsonable(o):
    if hasattr(o, "item"):
        return o.item()
    if isinstance(o, (set, tuple)):
        return list(o)
    return str(o)


def _clean(obj):
    """NaN/inf -> None all the way down (the page's data is JSON, which has neither)."""
    if isinstance(obj, float):
        return obj if obj == obj and obj not in (float("inf"), float("-inf")) else None
    if isinstance(obj, dict):
        return {str(k): _clean(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_clean(v) for v in obj]
    return obj


def build_report(mode_dir: str, out_dir: str | None = None, settings: ReportSettings = ReportSettings(), *,
                 progress: bool = True, workers: int = 0, start_method: str = "fork") -> dict:
    """Write (or bring up to date) the report of the run in ``mode_dir``; its stats (timings, sizes).

    In two phases: first the page and its tables, every rollout listed from its outcome and the store's
    cursor (seconds, whatever the run's size: the page works from here on), then each changed group's
    file (its rollouts' trees, decoded calls and tree columns of the table), rewriting the table every
    ``PUBLISH_EVERY_S`` while it builds, so a page reloaded meanwhile shows what is done.

    ``workers``: processes that build rollout files (0: one per CPU, up to 8, when there are more than
    ``PARALLEL_MIN`` rollouts to build); each opens the store with its own read-only reader.
    ``start_method``: "fork" from a plain process, "spawn" from one whose JAX backend is running
    (the ``report`` job, started by launch.main)."""
    t0 = time.perf_counter()
    out_dir = out_dir or os.path.join(mode_dir, "report")
    data = os.path.join(out_dir, "data")
    os.makedirs(os.path.join(data, "rollouts"), exist_ok=True)
    os.makedirs(os.path.join(out_dir, "assets"), exist_ok=True)
    old = _load_manifest(os.path.join(data, "manifest.json"), settings.key())
    sdir = _store_dir(mode_dir)
    meta, jobs, keys, store_info = _first_phase(sdir, settings, old, data)
    written = _publish(mode_dir, out_dir, settings, store_info, meta, run=True)
    t_page = time.perf_counter() - t0
    built, nbytes = _second_phase(jobs, keys, meta, sdir, mode_dir, out_dir, settings, store_info, workers,
                                  start_method, progress)
    written += nbytes
    if jobs:
        written += _publish(mode_dir, out_dir, settings, store_info, meta, run=True)
    return {"report": os.path.join(out_dir, "index.html"), "rollouts": sum(len(m["rows"]) for m in meta.values()),
            "groups": len(meta), "groups_built": built, "seconds": round(time.perf_counter() - t0, 3),
            "page_s": round(t_page, 3), "bytes_written": written, "bytes_total": _dir_bytes(out_dir),
            "bytes_data": _dir_bytes(data), "bytes_index": os.path.getsize(os.path.join(data, "index.js")),
            "bytes_run": os.path.getsize(os.path.join(data, "run.js"))}


def _first_phase(sdir: str | None, settings: ReportSettings, old: Mapping[str, dict], data: str):
    """(every group's entry: built ones from the manifest, the others' rows from their outcomes; the groups
    to build as jobs; their keys; the store's counts)."""
    from gyre_jax.trajectory.store import TrajectoryStore

    if sdir is None:
        return {}, [], {}, {}
    meta: dict[str, dict] = {}
    with TrajectoryStore(sdir, writable=False) as store:
        plan = _plan(store, settings, old, data)
        store_info = {"quarantined": len(store.quarantined()), "torn_tails": len(store.torn_tails()),
                      "unfinished": len(plan["unfinished"]), "complete": len(plan["complete"])}
        todo = set(plan["todo"])
        for g, rids in plan["groups"].items():  # the store's order; a group to build: its outcomes' rows
            meta[g] = old[g] if g not in todo else {"key": None, "members": rids, "rows": [rl_lib.outcome_row(
                r, store.outcome(r) if r in plan["complete"] else None, plan["trained"][r],
                plan["advantages"].get(r), _shard(g)) for r in rids]}
    jobs = [(g, plan["groups"][g], {r: plan["trained"][r] for r in plan["groups"][g]},
             {r: plan["advantages"][r] for r in plan["groups"][g] if r in plan["advantages"]}) for g in plan["todo"]]
    return meta, jobs, plan["keys"], store_info


def _second_phase(jobs, keys, meta, sdir, mode_dir, out_dir, settings, store_info, workers, start_method,
                  progress) -> tuple[int, int]:
    """Build each job's group file, updating ``meta``; (groups built, bytes written)."""
    from gyre_jax.rl.progress import Progress

    n_todo = sum(len(j[1]) for j in jobs)
    bar = Progress(total=n_todo, desc="report", enabled=progress and n_todo > 0, every_s=10.0,
                   line_per_step=False, unit="rollout")
    built = written = 0
    last = time.monotonic()
    data = os.path.join(out_dir, "data")
    try:
        for g, rows, nbytes in _run_jobs(jobs, sdir, mode_dir, data, settings, workers, start_method, n_todo):
            meta[g] = {"key": keys[g], "rows": rows, "members": meta[g]["members"]}
            written += nbytes
            built += 1
            bar.step(len(rows))
            if time.monotonic() - last >= PUBLISH_EVERY_S:
                written += _publish(mode_dir, out_dir, settings, store_info, meta, run=False)
                last = time.monotonic()
    except BaseException:  # stopped or failed: what was built stays built (the next build does the rest)
        if built:
            _publish(mode_dir, out_dir, settings, store_info, meta, run=False)
        raise
    finally:
        bar.close()
    return built, written


PUBLISH_EVERY_S = 15.0  # while groups build: the table (index.js) and the manifest rewritten this often


def _publish(mode_dir: str, out_dir: str, settings: ReportSettings, store_info: dict, meta: Mapping[str, dict], *,
             run: bool) -> int:
    """index.js and the manifest (a group not built yet has no key: the next build builds it); with ``run``,
    run.js (the run's tables read every row) and the page."""
    data = os.path.join(out_dir, "data")
    rows = [r for m in meta.values() for r in m["rows"]]
    n = _write_js(os.path.join(data, "index.js"), "window.GYRE_INDEX",
                  {"columns": list(rl_lib.INDEX_COLUMNS), "rows": rows})
    if run:
        n += _write_js(os.path.join(data, "run.js"), "window.GYRE_RUN",
                       _run_doc(mode_dir, [rl_lib.index_dict(r) for r in rows], settings, store_info))
        _copy_static(out_dir)
    _write_manifest(os.path.join(data, "manifest.json"), settings.key(), meta)
    return n


PARALLEL_MIN = 400  # rollouts to build below which one process does it (a worker's start costs seconds)


def _run_jobs(jobs, sdir, mode_dir, data, settings, workers, start_method, n_todo):
    """(group, its index rows, bytes written) for every job, as they finish; in worker processes when many."""
    n = workers or min(os.cpu_count() or 1, 8)
    if n <= 1 or n_todo < PARALLEL_MIN:
        yield from _build_groups(sdir, mode_dir, data, settings, jobs)
        return
    import concurrent.futures
    import multiprocessing

    chunks = [jobs[i::n * 4] for i in range(n * 4)]
    ctx = multiprocessing.get_context(start_method)
    with concurrent.futures.ProcessPoolExecutor(n, mp_context=ctx) as pool:
        futs = [pool.submit(_build_chunk, sdir, mode_dir, data, settings, c) for c in chunks if c]
        for fut in concurrent.futures.as_completed(futs):
            yield from fut.result()


def _build_chunk(sdir, mode_dir, data, settings, jobs) -> list:
    return list(_build_groups(sdir, mode_dir, data, settings, jobs))


def _build_groups(sdir, mode_dir, data, settings: ReportSettings, jobs):
    """Each job's group file (every rollout's detail) and index rows, from the store read here."""
    from gyre_jax.trajectory.store import TrajectoryStore

    decoder = TurnDecoder(settings.make_tokenizer())
    read_log = run_data.read_log_under(mode_dir, rl_lib.LOG_BYTES)
    with TrajectoryStore(sdir, writable=False) as store:
        complete = set(store.complete_rollouts())
        for g, rids, trained, advantages in jobs:
            details, rows = {}, []
            for rid in rids:
                outcome = store.outcome(rid) if rid in complete else None
                d, row = rl_lib.rollout_detail(rid, store.calls(rid), outcome, trained=trained[rid],
                                               advantage=advantages.get(rid), decoder=decoder, select=settings.select,
                                               read_log=read_log, shard=_shard(g))
                details[rid] = d
                rows.append(row)
            nbytes = _write_js(os.path.join(data, "rollouts", _shard(g) + ".js"), "gyreRollouts", details, call=True)
            yield g, _clean(rows), nbytes


def _plan(store, settings: ReportSettings, old: Mapping[str, dict], data: str) -> dict:
    """What the trainer did with each rollout, the groups, their cache keys, the groups to build and the
    advantages they need. Cheap when little changed: a group's key is its rollouts' ids, whether each is
    finished, and its trainer state and step (with the size of that step, so a step that changes
    rebuilds every group in it); outcomes are read only for new rollouts and the steps to rebuild."""
    import collections

    complete = set(store.complete_rollouts())
    unfinished = set(store.unfinished_rollouts())
    consumed = store.consumed()
    step_size = collections.Counter(c.get("step") for c in consumed.values())
    outcomes: dict[str, Any] = {}

    def outcome(rid):
        if rid not in outcomes:
            outcomes[rid] = store.outcome(rid)
        return outcomes[rid]

    trained: dict[str, rl_lib.Trained] = {}
    known = {rid: g for g, meta in old.items() for rid in meta.get("members", ())}
    groups: dict[str, list[str]] = {}
    for rid in store.rollout_ids():
        c = consumed.get(rid)
        trained[rid] = (rl_lib.Trained(c.get("state", "trained"), c.get("step"), c.get("reason")) if c is not None
                        else rl_lib.Trained("pending" if rid in complete else "running"))
        g = known.get(rid)
        if g is None:
            if rid in complete:
                g = outcome(rid).group_id
            elif rid in unfinished:
                g = store.calls(rid)[0].group_id
            else:
                continue
        groups.setdefault(g, []).append(rid)
    keys = {}
    for g, rids in groups.items():
        sig = [(r, r in complete, trained[r].state, trained[r].step, step_size.get(trained[r].step))
               for r in sorted(rids)]
        keys[g] = hashlib.sha1(json.dumps([settings.key(), sig], default=str).encode()).hexdigest()[:20]
    todo = [g for g in groups if old.get(g, {}).get("key") != keys[g]
            or not os.path.exists(os.path.join(data, "rollouts", _shard(g) + ".js"))]
    advantages = _advantages(todo, groups, trained, consumed, complete, outcome, settings)
    return {"unfinished": unfinished, "complete": complete, "trained": trained, "advantages": advantages,
            "groups": groups, "keys": keys, "todo": todo}


def _advantages(todo, groups, trained, consumed, complete, outcome, settings: ReportSettings) -> dict[str, float]:
    """Advantages of the rollouts to build: over each step they were trained in (every rollout of it), or,
    not taken yet, over their group."""
    steps = {trained[r].step for g in todo for r in groups[g] if trained[r].step is not None}
    peers: dict[Any, list] = {}
    for rid, c in consumed.items():
        if c.get("step") in steps and rid in complete:
            peers.setdefault(("step", c["step"]), []).append(outcome(rid))
    for g in todo:
        for rid in groups[g]:
            if trained[rid].step is None and rid in complete:
                o = outcome(rid)
                peers.setdefault(("group", getattr(o, settings.group_field)), []).append(o)
    advantages: dict[str, float] = {}
    for members in peers.values():
        try:
            advantages.update(rl_lib.step_advantages(members, settings.advantage, settings.group_field))
        except ValueError:  # rollouts that break the estimator's rules (e.g. a group of mixed tasks): shown without
            pass
    return advantages


def _run_doc(mode_dir: str, rows: Sequence[Mapping[str, Any]], settings: ReportSettings, store_info: dict) -> dict:
    from gyre_jax.scheduler.vocab import ROLE_COLORS, ROLE_LABELS  # the timeline PNGs' colours: one look

    att = run_data.attempts(mode_dir)
    summ = run_data.summary(mode_dir)
    return {
        "title": settings.title or os.path.basename(os.path.normpath(mode_dir)), "mode_dir": os.path.abspath(mode_dir),
        "generated_unix": time.time(), "state": run_data.run_state(att, summ is not None),
        "metrics": run_data.metrics(mode_dir), "evals": run_data.evals(mode_dir), "timeline": att,
        "roles": {"colors": ROLE_COLORS, "labels": ROLE_LABELS},
        "summary": summ, "steps": run_data.status_table(rows), "tasks": run_data.task_table(rows),
        "store": store_info, "settings": {"select": dataclasses.asdict(settings.select),
                                          "advantage": settings.advantage.estimator,
                                          "group_field": settings.group_field,
                                          "staleness_bound": settings.staleness_bound,
                                          "tokenizer": settings.tokenizer},
    }


def _load_manifest(path: str, key: str) -> dict:
    try:
        with open(path) as f:
            doc = json.load(f)
    except (OSError, ValueError):
        return {}
    return doc.get("groups", {}) if doc.get("settings") == key else {}


def _write_manifest(path: str, key: str, groups: Mapping[str, dict]) -> None:
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump({"settings": key, "groups": dict(groups)}, f, separators=(",", ":"))
    os.replace(tmp, path)


def _copy_static(out_dir: str) -> None:
    for name in ASSETS:
        src, dst = os.path.join(STATIC, name), os.path.join(out_dir, "assets", name)
        if not os.path.exists(dst) or os.path.getsize(dst) != os.path.getsize(src):
            shutil.copyfile(src, dst)
    with open(os.path.join(STATIC, "viewer.html")) as f:
        page = f.read()
    for name in ("viewer.css", "viewer.js"):  # inlined: the page is one file beside its data
        with open(os.path.join(STATIC, name)) as f:
            page = page.replace("/*@" + name + "@*/", f.read())
    with open(os.path.join(out_dir, "index.html"), "w") as f:
        f.write(page)


def _dir_bytes(d: str) -> int:
    return sum(os.path.getsize(os.path.join(r, f)) for r, _, fs in os.walk(d) for f in fs)
