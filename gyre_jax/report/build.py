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

    ``workers``: processes that build rollout files (0: one per CPU, up to 8, when there are more than
    ``PARALLEL_MIN`` rollouts to build); each opens the store with its own read-only reader.
    ``start_method``: "fork" from a plain process, "spawn" from one whose JAX backend is running
    (the ``report`` job, started by launch.main)."""
    from gyre_jax.rl.progress import Progress
    from gyre_jax.trajectory.store import TrajectoryStore

    t0 = time.perf_counter()
    out_dir = out_dir or os.path.join(mode_dir, "report")
    data = os.path.join(out_dir, "data")
    os.makedirs(os.path.join(data, "rollouts"), exist_ok=True)
    os.makedirs(os.path.join(out_dir, "assets"), exist_ok=True)
    manifest_path = os.path.join(data, "manifest.json")
    old = _load_manifest(manifest_path, settings.key())
    groups_meta: dict[str, dict] = {}
    built = written = 0
    store_info: dict = {}
    sdir = _store_dir(mode_dir)
    if sdir is not None:
        with TrajectoryStore(sdir, writable=False) as store:
            plan = _plan(store, settings)
            store_info = {"quarantined": len(store.quarantined()), "torn_tails": len(store.torn_tails()),
                          "unfinished": len(plan["unfinished"]), "complete": len(plan["outcomes"])}
        todo = [g for g, key in plan["keys"].items() if old.get(g, {}).get("key") != key
                or not os.path.exists(os.path.join(data, "rollouts", _shard(g) + ".js"))]
        jobs = [(g, plan["groups"][g], {r: plan["trained"][r] for r in plan["groups"][g]},
                 {r: plan["advantages"][r] for r in plan["groups"][g] if r in plan["advantages"]}) for g in todo]
        n_todo = sum(len(j[1]) for j in jobs)
        bar = Progress(total=n_todo, desc="report: rollouts", enabled=progress and n_todo > 0, every_s=10.0,
                       line_per_step=False)
        for g, rows, nbytes in _run_jobs(jobs, sdir, mode_dir, data, settings, workers, start_method, n_todo):
            groups_meta[g] = {"key": plan["keys"][g], "rows": rows}
            written += nbytes
            built += 1
            bar.step(len(rows))
        bar.close()
        for g in plan["groups"]:  # unchanged groups: their rows from the manifest, in the store's order
            if g not in groups_meta:
                groups_meta[g] = old[g]
        groups_meta = {g: groups_meta[g] for g in plan["groups"]}
    rows = [r for m in groups_meta.values() for r in m["rows"]]
    t_rollouts = time.perf_counter() - t0
    run = _run_doc(mode_dir, [rl_lib.index_dict(r) for r in rows], settings, store_info)
    written += _write_js(os.path.join(data, "run.js"), "window.GYRE_RUN", run)
    written += _write_js(os.path.join(data, "index.js"), "window.GYRE_INDEX",
                         {"columns": list(rl_lib.INDEX_COLUMNS), "rows": rows})
    _write_manifest(manifest_path, settings.key(), groups_meta)
    _copy_static(out_dir)
    seconds = time.perf_counter() - t0
    return {"report": os.path.join(out_dir, "index.html"), "rollouts": len(rows), "groups": len(groups_meta),
            "groups_built": built, "seconds": round(seconds, 3), "rollouts_s": round(t_rollouts, 3),
            "bytes_written": written, "bytes_total": _dir_bytes(out_dir), "bytes_data": _dir_bytes(data),
            "bytes_index": os.path.getsize(os.path.join(data, "index.js")),
            "bytes_run": os.path.getsize(os.path.join(data, "run.js"))}


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


def _plan(store, settings: ReportSettings) -> dict:
    """Outcomes, what the trainer did with each rollout, advantages, groups and their cache keys."""
    complete = store.complete_rollouts()
    outcomes = {rid: store.outcome(rid) for rid in complete}
    unfinished = store.unfinished_rollouts()
    consumed = store.consumed()
    trained: dict[str, rl_lib.Trained] = {}
    for rid in store.rollout_ids():
        c = consumed.get(rid)
        if c is not None:
            trained[rid] = rl_lib.Trained(c.get("state", "trained"), c.get("step"), c.get("reason"))
        else:
            trained[rid] = rl_lib.Trained("pending" if rid in outcomes else "running")
    by_step: dict[Any, list] = {}
    for rid, o in outcomes.items():
        t = trained[rid]
        key = ("step", t.step) if t.step is not None else ("group", getattr(o, settings.group_field))
        by_step.setdefault(key, []).append(o)
    advantages: dict[str, float] = {}
    for os_ in by_step.values():
        try:
            advantages.update(rl_lib.step_advantages(os_, settings.advantage, settings.group_field))
        except ValueError:  # a group that breaks the estimator's rules (e.g. mixed tasks): shown without
            pass
    groups: dict[str, list[str]] = {}
    for rid in store.rollout_ids():
        o = outcomes.get(rid)
        g = o.group_id if o is not None else store.calls(rid)[0].group_id if rid in unfinished else None
        if g is not None:
            groups.setdefault(g, []).append(rid)
    keys = {}
    for g, rids in groups.items():
        sig = [(r, trained[r].state, trained[r].step, outcomes[r].status if r in outcomes else None,
                advantages.get(r)) for r in sorted(rids)]
        keys[g] = hashlib.sha1(json.dumps([settings.key(), sig], default=str).encode()).hexdigest()[:20]
    return {"outcomes": outcomes, "unfinished": unfinished, "trained": trained, "advantages": advantages,
            "groups": groups, "keys": keys}


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


def _write_manifest(path: str, key: str, groups: dict) -> None:
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump({"settings": key, "groups": groups}, f, separators=(",", ":"))
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
