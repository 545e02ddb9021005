"""The loop's numbers: one record per step (metrics.jsonl, TensorBoard) and the run summary.

Everything a user needs to trust a step is in its record: reward and partial
credit, failures by class, what rollout sandboxes refused, staleness, what the Jmax path budget dropped
(trainable tokens and paths kept vs total), prefix-sharing savings, throughput,
role switches and their failures, weight moves (bytes, seconds), cells that
failed or went out of service.
"""
from __future__ import annotations

import collections
import dataclasses
import json
import os
import types
from typing import Any, Mapping, Sequence

import numpy as np

from gyre_jax.rl import attempts as attempts_lib
from gyre_jax.rl import summary as summary_lib
from gyre_jax.rl.step_events import StepDone, StepTotals
from gyre_jax.scheduler import policy as policy_lib
from gyre_jax.scheduler.vocab import ROLLOUT, TRAIN


def scalars(rec) -> dict:
    """A step record (or its dict) as the metrics writer takes it: scalars and strings only."""
    out = {}
    for k, v in (rec.values.items() if isinstance(rec, StepRecord) else rec.items()):
        if k == "step" or v is None:
            continue
        if isinstance(v, (list, tuple)):
            v = ",".join(str(x) for x in v)
        out[k] = v
    return out


@dataclasses.dataclass(frozen=True)
class StepRecord:
    """One step's line of metrics.jsonl: its step and its named values (read-only).

    Indexing reads a value (``rec["reward"]``; ``rec["step"]`` is the step), as a line read back
    from metrics.jsonl is read, so a run's summary takes this run's records and earlier attempts'
    lines alike."""

    step: int
    values: Mapping[str, Any]

    def __post_init__(self):
        object.__setattr__(self, "values", types.MappingProxyType(dict(self.values)))

    def __getitem__(self, key: str):
        return self.step if key == "step" else self.values[key]

    def __contains__(self, key: str) -> bool:
        return key == "step" or key in self.values

    def get(self, key: str, default=None):
        return self[key] if key in self else default

    def with_values(self, extra: Mapping[str, Any]) -> "StepRecord":
        return StepRecord(self.step, {**self.values, **extra})


def _nan_or(scores: np.ndarray, fn) -> float:
    return float(fn(scores)) if scores.size else float("nan")


def reward_metrics(done: StepDone) -> dict:
    """Reward and partial credit of the step's trained rollouts, and what failed by class."""
    scores = np.asarray(done.scores, np.float64)
    t = done.totals
    return {"reward": _nan_or(scores, np.mean), "exact": _nan_or(scores, lambda s: (s == 1.0).mean()),
            "partial_credit": _nan_or(scores, lambda s: ((s > 0) & (s < 1)).mean()),
            "rollouts": done.rollouts, "trained_rollouts": t.trained_rollouts,
            **{f"failures/{k}": v for k, v in t.failures.items()},
            "staleness_mean": done.report.staleness_mean, "staleness_max": done.report.staleness_max,
            "groups": list(done.groups), "group_versions": list(done.group_versions),  # in the order taken
            "resume/extra_groups": done.extra_groups, "resume/replayed": int(done.replayed)}


AUDIT_EXAMPLES = 3  # rollout ids kept per audit category per step


def outcome_reason(o) -> str | None:
    """Why a rollout failed or scored 0 without a plain verdict (None: an ordinary grade)."""
    d = o.details or {}
    if d.get("reason"):
        return f"{o.status}: {d['reason']}"
    grader = d.get("grader") or {}
    if grader.get("tampered"):
        return f"{o.status}: tampering with the test run"
    return f"{o.status}: {d.get('error') or 'no reason recorded'}"[:200] if o.is_failure else None


def outcome_metrics(done: StepDone) -> dict:
    """The step's rollouts by status, their top failure reasons, and the reward-hack audit: per
    category of ``tree_rules`` (runner configuration, bytecode, shadowing modules, files outside
    the solution paths, hidden/protected names...), the rollouts whose workspace wrote such a
    path (refused by the graded tree: it never reached the grader), with example rollout ids."""
    from gyre_jax.agents.tree_rules import CATEGORIES
    from gyre_jax.trajectory.vocab import STATUSES

    outs = done.outcomes
    statuses = collections.Counter(o.status for o in outs)
    reasons = collections.Counter(r for o in outs if (r := outcome_reason(o)) is not None)
    audit: dict[str, list[str]] = {c: [] for c in CATEGORIES}
    for o in outs:
        refused = ((o.details or {}).get("grader") or {}).get("tree", {}).get("refused", {})
        for c in CATEGORIES:
            if refused.get(c):
                audit[c].append(o.rollout_id)
    return {**{f"statuses/{k}": statuses.get(k, 0) for k in STATUSES},
            "reasons": "; ".join(f"{r} x{n}" for r, n in reasons.most_common(3)),
            **{f"audit/{c}": len(ids) for c, ids in audit.items()},
            "audit/examples": "; ".join(f"{c}: {','.join(ids[:AUDIT_EXAMPLES])}" for c, ids in audit.items() if ids)}


def status_line(rec) -> str:
    """The step's statuses and top reason for the progress line ('' when every rollout was graded)."""
    counts = {k.split("/", 1)[1]: v for k, v in (rec.values if isinstance(rec, StepRecord) else rec).items()
              if k.startswith("statuses/") and v}
    if not rec.get("reasons") and set(counts) <= {"completed"}:
        return ""
    short = " ".join(f"{k}={v}" for k, v in counts.items())
    top = str(rec.get("reasons") or "").split("; ")[0][:120]
    return f"statuses {short}" + (f" (top: {top})" if top else "") + " "


def audit_totals(history: Sequence[Any]) -> dict:
    """The run's audit: rollouts per category over its steps, and the first example rollout ids."""
    from gyre_jax.agents.tree_rules import CATEGORIES

    out: dict[str, Any] = {c: int(sum(r.get(f"audit/{c}", 0) or 0 for r in history)) for c in CATEGORIES}
    examples: dict[str, list[str]] = {}
    for r in history:
        for part in str(r.get("audit/examples", "") or "").split("; "):
            cat, _, ids = part.partition(": ")
            if ids:
                examples.setdefault(cat, []).extend(i for i in ids.split(",") if i)
    out["examples"] = {c: ids[:5] for c, ids in examples.items()}
    return out


def tree_metrics(t: StepTotals) -> dict:
    """What the Jmax path budget cost (each unique trainable token once) and what the trees did:
    branching, compactions, sub-agents, retries; dedup_factor is the tokens every selected path
    would cost trained alone over the tokens packed."""
    n = max(t.trained_rollouts, 1)
    return {
        "dedup_factor": t.dedup_factor, "trainable_tokens": t.trainable_unique,
        "trainable_tokens_kept": t.trainable_selected, "trainable_tokens_dropped": t.trainable_dropped,
        "paths": t.paths_total, "paths_kept": t.paths_selected, "rollouts_truncated": t.rollouts_truncated,
        "max_dropped_fraction": t.max_dropped_fraction,
        **{f"trees/{k}": getattr(t, k) for k in ("branching_rollouts", "branch_points", "compaction_calls",
                                                  "subagent_calls", "retried_calls")},
        "trees/paths_per_rollout": t.paths_total / n, "trees/branch_points_per_rollout": t.branch_points / n,
        "trees/branching_rollout_fraction": t.branching_rollouts / n,
        "trees/expanded_tokens": t.expanded_tokens, "trees/packed_tokens": t.packed_tokens,
    }


def routing_metrics(stats: Mapping[str, float]) -> dict:
    """An MoE run's ``routing_mismatch``: of the step's trained tokens with recorded routing, the
    fraction whose live top-k experts differ from the engine's in some MoE layer (cells/loss.py).
    With routing replay on, the tokens whose routing replay fixed; off, those trained off-route.
    NaN when no trained token had recorded routing (an engine that records none): not "no mismatch"."""
    n = stats.get("routing_recorded_tokens")
    if n is None:
        return {}
    return {"routing_mismatch": float(stats["routing_mismatch_tokens"]) / n if n > 0 else float("nan")}


def train_metrics(done: StepDone) -> dict:
    """The update: loss terms, the estimator's counts, the per-step pass (cells/score.py), DAPO's
    dynamic sampling (groups dropped for no signal since the last record; each replaced), timing."""
    rep = done.report
    return {
        "rows": done.rows, "micro_batches": done.micro_batches,
        "params_hash": done.params_hash or None,  # the new version's params (cells.fingerprint)
        "loss": rep.loss, "grad_norm": rep.grad_norm, "learning_rate": rep.learning_rate, "grad_scale": rep.grad_scale,
        **{f"loss/{k}": v for k, v in rep.stats.items() if k != "loss"},
        **routing_metrics(rep.stats),
        **{f"adv/{k}": v for k, v in done.totals.advantage_metrics.items()},
        **{f"score/{k}": v for k, v in done.score.items()},
        "dynamic_sampling/dropped_groups": done.dropped_groups,
        "train_tokens_per_s": done.totals.packed_tokens / max(rep.seconds, 1e-9), "train_step_s": rep.seconds,
        "train_busy_cell_s": rep.busy_cell_s,
        "process_s": done.process_s, "cells_trained": list(done.cells_used),
        # Streaming: rows came in one chunk per group, and only the last group's rows and the
        # update were left once it was in; a whole step: one chunk, all its training after.
        "row_chunks": done.row_chunks, "after_last_group_s": done.after_last_group_s,
        "failed_cells": [c for c, _ in rep.failed_cells],
    }


class StepRecorder:
    """Turns the trainer's ``StepDone`` into a ``StepRecord``; remembers counters between steps."""

    def __init__(self, *, clock, server, timeline, launcher, pool, controller=None):
        self.clock, self.server, self.timeline, self.launcher, self.pool = clock, server, timeline, launcher, pool
        self.controller = controller  # its online estimates go into each record as sched/*
        self._t = clock.now()
        self._gen = 0
        self._switches = 0
        self._moves = len(pool.moves())
        self._failures = len(pool.failures)
        self._results = 0
        self._engine_s = self._engine_seconds()

    def record(self, done: StepDone) -> StepRecord:
        now = self.clock.now()
        values = {"version": done.version, "time_s": now, **reward_metrics(done), **outcome_metrics(done),
                  **tree_metrics(done.totals),
                  **train_metrics(done), **self._cluster_view(now), **self._scheduler_view()}
        self._t = now
        return StepRecord(done.step, values)

    def _cluster_view(self, now: float) -> dict:
        """Generation, role switches and weight moves since the last record, and the cluster's counters."""
        counters = self.server.proxy.counters
        gen = int(counters.get("completion_tokens", 0))
        sw = self.timeline.switches_since(self._switches)
        moves = self.pool.moves()[self._moves:]
        results = self.launcher.results
        out = {
            "gen_tokens_per_s": (gen - self._gen) / max(now - self._t, 1e-9),
            "switches": len(sw), "switch_s_mean": float(np.mean([x.seconds for x in sw])) if sw else 0.0,
            "switch_s_max": float(np.max([x.seconds for x in sw])) if sw else 0.0,
            "switch_failures": len(self.pool.failures) - self._failures, "cells_out": len(self.pool.out),
            "weight_moves": len(moves), "weight_move_bytes": int(sum(m.bytes for m in moves)),
            "weight_move_s": float(sum(m.seconds for m in moves)),
            "rollouts_in_flight": self.launcher.running_rollouts(), "roles": self.pool.roles(),
            "engine_errors": int(counters.get("engine_errors", 0)),
            "retries": int(sum(r["retries"] for r in results)),
            # Tool commands run in rollout sandboxes, refusals and limits hit (cumulative, like retries).
            **{k: int(sum(r.get(k, 0) for r in results)) for k in ("sandbox_commands", "sandbox_violations",
                                                                   "sandbox_limits_hit")},
        }
        out.update(self._time_split(results[self._results:]))
        self._gen, self._switches = gen, self._switches + len(sw)
        self._moves, self._failures = self._moves + len(moves), len(self.pool.failures)
        self._results = len(results)
        return out

    def _engine_seconds(self) -> dict[str, float]:
        """Seconds the rollout engines spent prefilling and decoding so far (summed over engines)."""
        total = {"prefill_s": 0.0, "generate_s": 0.0}
        for backend in list(getattr(getattr(self.server.proxy, "router", None), "cells", {}).values()):
            counters = getattr(getattr(backend, "engine", None), "counters", None) or {}
            for k in total:
                total[k] += float(counters.get(k, 0.0))
        return total

    def _time_split(self, finished: list[dict]) -> dict:
        """Where the step's time went, summed over what ran in it (overlapping, so not a partition of the wall
        time): the engines' prefill and decode, the agents' own time outside model calls (their tools), the
        graders, and, from the trainer, packing (process_s) and training (train_step_s)."""
        eng = self._engine_seconds()
        # Tools: the agent's time outside its recorded calls, over rollouts that ended by themselves (a call cut
        # by the deadline is never recorded: its wait would count as tool time).
        ended = [r for r in finished if r.get("status") != "timeout"]
        tools = sum(max(0.0, float(r.get("agent_s") or 0.0) - float(r.get("model_s") or 0.0)) for r in ended)
        out = {"time/prefill_s": eng["prefill_s"] - self._engine_s["prefill_s"],
               "time/decode_s": eng["generate_s"] - self._engine_s["generate_s"],
               "time/model_calls_s": sum(float(r.get("model_s") or 0.0) for r in finished), "time/tools_s": tools,
               "time/grading_s": sum(float(r.get("grader_s") or 0.0) for r in finished)}
        self._engine_s = eng
        return out

    def _scheduler_view(self) -> dict:
        """What the controller measured and what its policy concludes from it now: the
        numbers behind each role switch and admission (None = not measured yet: the prior)."""
        ctl = self.controller
        if ctl is None or ctl.estimates is None:
            return {}
        state = ctl.last_state  # read, not observed: observing would feed the estimates from this thread
        if state is None:
            return {}
        out = {f"sched/{k}": v for k, v in dataclasses.asdict(state.measured).items()}
        out["sched/train_cells_target"] = policy_lib.train_cells_target(state, ctl.config)
        out["sched/max_running_rollouts"] = policy_lib.max_running_rollouts(state, ctl.config)
        return out


def run_summary(*, cfg, workdir: str, history: list, evals: list[dict], segments, n_cells: int,
                step_end_s: list[float], wall_rl: float, wall: float, launcher, timeline, pool, server, injected: dict,
                sft_history: list[dict], earlier: Sequence[dict] = (), attempts: Sequence[dict] = (),
                statuses: Mapping[str, int] | None = None, task_check: dict | None = None) -> dict:
    """summary.json (and the timeline PNG) of the run; printed as one line plus the modes table.

    The top level describes the whole run, every attempt of it (a run resumed after a failure, a kill
    or a stop is one run): its steps are this attempt's ``history`` after ``earlier`` (the step records
    of attempts before this one, from metrics.jsonl, which keeps exactly one line per step of the
    lineage that survived), its timeline and wall time every attempt's (``attempts``: their records,
    ``rl.attempts``, this one last), its statuses every finished rollout's (``statuses``, counted from
    the store). ``attempt`` holds this attempt's own numbers, as the top level read before resumes
    were summed (``tests/test_run_records.py``)."""
    h = [r if isinstance(r, Mapping) else dict(r.values, step=r.step) for r in history]
    records = list(earlier) + h
    this = _attempt_summary(cfg, h, evals, segments, n_cells, wall_rl, wall, launcher, timeline, pool, server,
                            injected, sft_history)
    attempts = list(attempts) or [{"attempt": 0, "duration_s": wall_rl, "setup_s": wall - wall_rl,
                                   "segments": segments, "step_ends": [], "n_cells": n_cells}]
    all_segments, step_ends, restarts, rl_total = attempts_lib.whole_timeline(attempts)
    if len(attempts) == 1:  # this attempt alone: its own step ends (the file may lag the last step by a write)
        step_ends = [(i, t) for i, t in enumerate(step_end_s)]
    summary_lib.plot_timeline(all_segments, n_cells, [t for _, t in step_ends], os.path.join(workdir, "timeline.png"),
                              title=f"gyre_jax RL loop, mode={cfg.scheduler.mode}: cell roles over time"
                              + (f" ({len(attempts)} attempts)" if len(attempts) > 1 else ""),
                              restarts=[(t, f"attempt {a} resumes at step {s}") for t, a, s in restarts])
    out = {"mode": cfg.scheduler.mode, "updates_per_publication": cfg.scheduler.updates_per_publication,
           "attempts": len(attempts),
           "wall_s": sum(float(a.get("setup_s", 0.0)) + float(a.get("duration_s", 0.0)) for a in attempts[:-1]) + wall,
           **_run_totals(records, all_segments, n_cells, rl_total, cfg.first_last),
           "cells_out": dict(pool.out),
           "statuses": dict(statuses) if statuses is not None else this["statuses"],
           # what this attempt counted, plus what the earlier attempts' records say they did
           **attempts_lib.add_counters([*attempts[:-1], {"counters": {k: this[k] for k in COUNTERS}}]),
           "sft_steps": next((a["sft_steps"] for a in attempts if a.get("sft_steps")), this["sft_steps"]),
           "sft_loss_last": next((a["sft_loss_last"] for a in attempts if a.get("sft_steps")), this["sft_loss_last"]),
           # rollouts whose workspace wrote runner configuration, bytecode, shadowing modules, ... (tree_rules)
           "audit": audit_totals(records),
           "task_check": dict(task_check or {}),
           "attempt": this}
    out.update(eval_fields(merge_evals(os.path.join(workdir, "eval", "eval.jsonl"), records, evals)))
    out = json_safe(out)
    with open(os.path.join(workdir, "summary.json"), "w") as f:
        json.dump(out, f, indent=1, allow_nan=False)
    _print_summary(out, h)
    print(summary_lib.table(summary_lib.mode_summaries(os.path.dirname(workdir))), flush=True)
    print(f"rl[{out['mode']}]: every rollout, its tree and calls, per task and per step: python -m gyre_jax.report "
          f"{workdir}", flush=True)
    return out


COUNTERS = ("engine_errors", "retries", "group_failures", "rerun_rollouts", "injected_faults")


def _run_totals(records: Sequence[Mapping], segments, n_cells: int, rl_s: float, first_last: int) -> dict:
    """The numbers of summary.json's top level that add up over every step record and every attempt's time."""
    def total(key) -> float:
        return sum(_num(r.get(key), 0) for r in records)

    k = min(first_last, max(1, len(records) // 2))
    rewards = [_num(r.get("reward")) for r in records]
    util = summary_lib.utilization(segments, n_cells, rl_s)
    return {
        "steps": len(records), "first_step": int(records[0]["step"]) if records else None, "rl_s": rl_s,
        "reward_first": _nanmean(rewards[:k]), "reward_last": _nanmean(rewards[-k:]), "first_last_steps": k,
        "util_rollout": util[ROLLOUT], "util_train": util[TRAIN], "util_switching": util["switching"],
        # cell-time actually computing micro-batches (the rest of train role is waiting)
        "util_train_busy": total("train_busy_cell_s") / max(n_cells * rl_s, 1e-9),
        "staleness_mean": _nanmean([_num(r.get("staleness_mean")) for r in records], 0.0),
        "staleness_max": float(max((_num(r.get("staleness_max"), 0.0) for r in records), default=0.0)),
        "switches": int(total("switches")), "switch_failures": int(total("switch_failures")),
        "trainable_tokens_dropped": int(total("trainable_tokens_dropped")),
        "trainable_tokens": int(total("trainable_tokens")), "weight_move_bytes": int(total("weight_move_bytes")),
        "trees": tree_totals(records),
    }


def _print_summary(out: Mapping, h: Sequence[Mapping]) -> None:
    if not out["steps"]:
        return
    resumed = f" (this attempt: {len(h)} steps from step {h[0]['step']})" if out["attempts"] > 1 and h else ""
    f = lambda v: "nan" if v is None else f"{v:.3f}"  # noqa: E731 - null in JSON: no step was scored
    print(f"rl[{out['mode']}]: reward {f(out['reward_first'])} -> {f(out['reward_last'])} (mean of first/last "
          f"{out['first_last_steps']} steps), {out['steps']} steps in {out['rl_s']:.1f}s of RL ({out['wall_s']:.1f}s "
          f"total){resumed}, staleness mean {out['staleness_mean']:.2f} max {out['staleness_max']:.0f}; statuses "
          f"{out['statuses']}" + (f"; held-out eval {f(out['eval_first'])} -> {f(out['eval_last'])} (versions "
                                  f"{out['eval_first_version']} -> {out['eval_last_version']})"
                                  if "eval_first" in out else ""), flush=True)


def _attempt_summary(cfg, h, evals, segments, n_cells, wall_rl, wall, launcher, timeline, pool, server, injected,
                     sft_history) -> dict:
    """This attempt's numbers (what summary.json's top level held before a run's attempts were summed)."""
    k = min(cfg.first_last, max(1, len(h) // 2))
    util = summary_lib.utilization(segments, n_cells, wall_rl)
    out = {
        "steps": len(h), "first_step": int(h[0]["step"]) if h else None, "wall_s": wall, "rl_s": wall_rl,
        "reward_first": _nanmean([_num(r["reward"]) for r in h[:k]]),
        "reward_last": _nanmean([_num(r["reward"]) for r in h[-k:]]), "first_last_steps": k,
        "util_rollout": util[ROLLOUT], "util_train": util[TRAIN], "util_switching": util["switching"],
        "util_train_busy": sum(r["train_busy_cell_s"] for r in h) / max(n_cells * wall_rl, 1e-9),
        "staleness_mean": float(np.mean([r["staleness_mean"] for r in h])) if h else 0.0,
        "staleness_max": float(max([r["staleness_max"] for r in h], default=0.0)),
        "switches": timeline.switch_count(), "switch_failures": len(pool.failures), "cells_out": dict(pool.out),
        "statuses": dict(launcher.statuses), "group_failures": len(launcher.group_failures),
        "rerun_rollouts": launcher.rerun_rollouts,
        "trainable_tokens_dropped": int(sum(r["trainable_tokens_dropped"] for r in h)),
        "trainable_tokens": int(sum(r["trainable_tokens"] for r in h)),
        "weight_move_bytes": int(sum(r["weight_move_bytes"] for r in h)),
        "engine_errors": int(server.proxy.counters.get("engine_errors", 0)),
        "retries": int(sum(r["retries"] for r in launcher.results)),
        "injected_faults": injected,
        "sft_steps": len(sft_history), "sft_loss_last": sft_history[-1]["loss"] if sft_history else None,
        "trees": tree_totals(h),
    }
    out.update(eval_fields(evals))
    return out


def eval_fields(evals: Sequence[dict]) -> dict:
    """The held-out eval's first and last (and, for whole episodes, pass@k and the whole curve)."""
    if not evals:
        return {}
    out = dict(eval_first=evals[0]["eval_reward"], eval_last=evals[-1]["eval_reward"],
               eval_first_version=evals[0]["version"], eval_last_version=evals[-1]["version"],
               eval_exact_first=evals[0].get("eval_exact"), eval_exact_last=evals[-1].get("eval_exact"))
    if "eval_pass_at_k" in evals[-1]:  # whole episodes (eval.kind=episodes): pass@k and the whole curve
        out.update(eval_pass_at_k_first=evals[0].get("eval_pass_at_k"),
                   eval_pass_at_k_last=evals[-1]["eval_pass_at_k"], eval_k=evals[-1]["eval_k"], evals=list(evals))
    return out


def merge_evals(eval_jsonl: str, records: Sequence[Mapping], evals: Sequence[dict]) -> list[dict]:
    """The run's held-out evals, one per version, oldest first: earlier attempts' whole-episode evals from
    eval.jsonl (``eval/<metric>`` at step = version), first-call evals from the step records (``eval/*``
    and the starting policy's ``eval/*_start``), and this attempt's own (``evals``), which win."""
    by_version: dict[int, dict] = {}
    if os.path.exists(eval_jsonl):
        with open(eval_jsonl) as f:
            for line in f:
                try:
                    r = json.loads(line)
                except ValueError:
                    continue  # a torn last line
                if isinstance(r, dict) and isinstance(r.get("step"), int) and "eval/reward" in r:
                    by_version[r["step"]] = {"version": r["step"], **{"eval_" + k[5:]: _num(v) for k, v in r.items()
                                                                       if k.startswith("eval/")}}
    for r in records:
        for suffix in ("_start", ""):
            if f"eval/reward{suffix}" in r and f"eval/version{suffix}" in r:
                v = int(r[f"eval/version{suffix}"])
                by_version.setdefault(v, {"version": v, **{
                    "eval_" + k[5:len(k) - len(suffix)]: _num(x) for k, x in r.items()
                    if k.startswith("eval/") and k.endswith(suffix) and (suffix or not k.endswith("_start"))}})
    for e in evals:
        by_version[int(e["version"])] = dict(e)
    return [by_version[v] for v in sorted(by_version)]


def _num(v, default=float("nan")):
    """A metric read back from JSON: null (a non-finite float, rl/metrics.py) is NaN, or ``default``."""
    return default if v is None else v


def _nanmean(xs, default=float("nan")) -> float:
    a = np.asarray([x for x in xs if x is not None], np.float64)
    return float(np.nanmean(a)) if a.size and not np.isnan(a).all() else default


def json_safe(obj):
    """``obj`` with every non-finite float as None: JSON has no NaN or Infinity (Python's json writes bare
    ``NaN``, which other readers refuse). A NaN mean (no rollout scored) reads back as null."""
    if isinstance(obj, float):
        return obj if np.isfinite(obj) else None
    if isinstance(obj, Mapping):
        return {k: json_safe(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [json_safe(v) for v in obj]
    if isinstance(obj, np.generic):
        return json_safe(obj.item())
    return obj


def tree_totals(history: Sequence[Mapping]) -> dict:
    """What the trees did over the run's steps (the per-step ``trees/*`` fields, summed)."""
    def total(k):
        return int(sum(r.get(f"trees/{k}", 0) for r in history))

    trained = int(sum(r.get("trained_rollouts", 0) for r in history))
    packed = total("packed_tokens")
    return {
        "trained_rollouts": trained,
        "branching_rollout_fraction": total("branching_rollouts") / max(trained, 1),
        "paths_per_rollout": int(sum(r.get("paths", 0) for r in history)) / max(trained, 1),
        "branch_points_per_rollout": total("branch_points") / max(trained, 1),
        "compaction_calls": total("compaction_calls"), "subagent_calls": total("subagent_calls"),
        "retried_calls": total("retried_calls"),
        "dedup_factor_real": total("expanded_tokens") / packed if packed else 0.0,
    }


def store_statuses(store) -> dict[str, int]:
    """Finished rollouts of the whole run by status, from the store (every attempt's; a rollout a stop cut
    off and the rerun ran again counts as the infra_error it was recorded as, and its rerun by its own)."""
    out: dict[str, int] = {}
    for rid in store.complete_rollouts():
        o = store.outcome(rid)
        out[o.status] = out.get(o.status, 0) + 1
    return out


def earlier_records(jsonl_path: str, before_step: int) -> list[dict]:
    """Step records of metrics.jsonl with step < ``before_step`` (what earlier attempts trained)."""
    if before_step <= 0 or not os.path.exists(jsonl_path):
        return []
    out = []
    with open(jsonl_path) as f:
        for line in f:
            try:
                rec = json.loads(line)
            except ValueError:
                continue  # a torn last line of a killed attempt
            if isinstance(rec, dict) and isinstance(rec.get("step"), int) and rec["step"] < before_step:
                out.append(rec)
    return sorted(out, key=lambda r: r["step"])
