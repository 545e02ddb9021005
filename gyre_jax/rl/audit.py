"""Audit of a finished (or stopped) RL workdir from its own records: was every rollout trained once?

Reads only what the run made durable: the trajectory store (every finished rollout's
outcome, and the cursor: which rollouts were trained or dropped, at which step) and
``metrics.jsonl`` (one line per step of the surviving lineage, with the groups it
trained). It trusts neither the process that wrote them nor its summary, so a test or
``tools/bench_chaos.py`` can run it on a workdir left by any sequence of kills.

What it counts (all 0 in a healthy run that reached its end):

* ``rollouts_lost``: finished rollouts (outcome stored, all calls in) never consumed;
* ``rollouts_trained_twice``: a group slot with more than one trained attempt, plus the
  trained rollouts of a group that metrics.jsonl lists in more than one step;
* ``wrong_state``: a failed rollout trained, or a good one dropped for a reason other
  than DAPO's ``no_signal``, or dropped with a reason that is not its status;
* ``groups_short``: consumed groups with fewer than ``group_size`` slots that ended in
  a real outcome (trained, or dropped for their own failure; an ``abandoned`` attempt,
  the infra_error a resume gives a rollout a kill cut off, does not fill its slot);
* ``staleness_max``: over trained rollouts, the step that trained it minus the oldest
  policy version that sampled it (the trainer's token staleness, per rollout);
* ``unfinished``: rollouts with calls and no outcome (in flight when the run stopped);
* ``infra_errors``: ``infra_error`` outcomes other than ``abandoned`` (a harness or
  infrastructure failure that became data: what a full disk must never cause).

Also reported, not a fault: ``oversized_steps`` and ``extra_groups``, the steps of the surviving
lineage that took more than ``groups_per_step`` groups and how many more (metrics.jsonl's
``resume/extra_groups``): how a resume past the staleness bound keeps it (``policy.resume_step_sizes``);
``replayed_steps``, the steps a resume trained again from their records (``rl.replay``); and the params
hash comparison: each line a rewind purged (``metrics.purged.jsonl``: a stopped attempt's steps past its
last checkpoint) against the surviving lineage's line of the same step, ``params_hash_equal`` /
``params_hash_differ`` (a replayed step must be equal; one trained anew after a step that could not be
replayed may differ).
"""
from __future__ import annotations

import collections
import json
import os
import re

from gyre_jax.trajectory.store import TrajectoryStore

_ROLLOUT_ID = re.compile(r"^(g\d+)-(\d+)(?:\.r(\d+))?$")  # the launcher's <group>-<slot>[.r<attempt>]
NO_SIGNAL = "no_signal"


def store_view(mode_dir: str):
    """(finished rollout id -> outcome, consumed cursor, unfinished ids) of ``mode_dir/store``."""
    with TrajectoryStore(os.path.join(mode_dir, "store"), writable=False) as store:
        outs = {r: store.outcome(r) for r in store.complete_rollouts()}
        return outs, store.consumed(), store.unfinished_rollouts()


def consumed_once_problems(outs: dict, consumed: dict) -> list[str]:
    """Why ``consumed`` is not "every finished rollout consumed once, in the state its outcome says"."""
    bad = [f"lost (finished, never consumed): {r}" for r in sorted(set(outs) - set(consumed))]
    bad += [f"consumed but not finished: {r}" for r in sorted(set(consumed) - set(outs))]
    for rid in sorted(set(outs) & set(consumed)):
        bad += [f"{rid}: {p}" for p in _state_problems(outs[rid], consumed[rid])]
    return bad


def _state_problems(o, e: dict) -> list[str]:
    if o.is_failure and e["state"] != "dropped":
        return [f"a {o.status} rollout was {e['state']}"]
    if o.is_failure and e["reason"] != o.status:
        return [f"a {o.status} rollout was dropped as {e['reason']!r}"]
    if not o.is_failure and e["state"] == "dropped" and e["reason"] != NO_SIGNAL:
        return [f"a {o.status} rollout was dropped as {e['reason']!r}"]
    return []


def audit_workdir(mode_dir: str, *, group_size: int, staleness_bound: int) -> dict:
    """The counts in the module docstring, for ``mode_dir`` (e.g. ``W/elastic``)."""
    outs, consumed, unfinished = store_view(mode_dir)
    slots: dict[str, dict[int, list[str]]] = collections.defaultdict(lambda: collections.defaultdict(list))
    for rid, e in consumed.items():
        m = _ROLLOUT_ID.match(rid)
        if m is not None:
            slots[m.group(1)][int(m.group(2))].append(rid)
    twice = 0
    short = 0
    for gid, by_slot in slots.items():
        filled = 0
        for ids in by_slot.values():
            trained = [r for r in ids if consumed[r]["state"] == "trained"]
            twice += max(0, len(trained) - 1)
            real = [r for r in ids if r in outs and "abandoned" not in (outs[r].details.get("error") or "")]
            filled += bool(real)
        short += filled < group_size
    steps_of_group = collections.defaultdict(set)
    steps = []
    extra = []  # resume/extra_groups of each step that took more than G groups
    hashes: dict[int, str] = {}
    replayed = 0
    for r in _lines(os.path.join(mode_dir, "metrics.jsonl")):
        steps.append(r["step"])
        if r.get("resume/extra_groups"):
            extra.append(int(r["resume/extra_groups"]))
        replayed += bool(r.get("resume/replayed"))
        if r.get("params_hash"):
            hashes[r["step"]] = r["params_hash"]
        for g in filter(None, str(r.get("groups", "")).split(",")):
            steps_of_group[g].add(r["step"])
    compared = [(r["params_hash"], hashes[r["step"]]) for r in _lines(os.path.join(mode_dir, "metrics.purged.jsonl"))
                if r.get("params_hash") and isinstance(r.get("step"), int) and r["step"] in hashes]
    for gid, ss in steps_of_group.items():
        if len(ss) > 1:
            twice += (len(ss) - 1) * sum(consumed[r]["state"] == "trained" for ids in slots.get(gid, {}).values() for r in ids)
    stale = {r: e["step"] - min(outs[r].policy_versions) for r, e in consumed.items()
             if e["state"] == "trained" and r in outs and outs[r].policy_versions}
    st_max = max(stale.values(), default=0)
    # which rollouts trained past the bound (a few, to find why): id, step, the versions that sampled it
    over = sorted((r for r, s in stale.items() if s > staleness_bound), key=lambda r: (-stale[r], r))[:5]
    wrong = sum(bool(_state_problems(outs[r], e)) for r, e in consumed.items() if r in outs)
    return dict(
        finished=len(outs), trained=sum(e["state"] == "trained" for e in consumed.values()),
        dropped=sum(e["state"] == "dropped" for e in consumed.values()),
        rollouts_lost=len(set(outs) - set(consumed)), consumed_not_finished=len(set(consumed) - set(outs)),
        rollouts_trained_twice=twice, wrong_state=wrong, groups=len(slots), groups_short=short,
        staleness_max=st_max, max_staleness_over_bound=max(0, st_max - staleness_bound),
        over_bound_examples=[[r, consumed[r]["step"], list(outs[r].policy_versions)] for r in over],
        unfinished=len(unfinished),
        infra_errors=sum(o.status == "infra_error" and not str(o.details.get("error", "")).startswith("abandoned")
                         for o in outs.values()),
        metrics_steps=len(steps), duplicate_steps=len(steps) - len(set(steps)),
        oversized_steps=len(extra), extra_groups=sum(extra), replayed_steps=replayed,
        params_hash_equal=sum(a == b for a, b in compared), params_hash_differ=sum(a != b for a, b in compared),
    )


def _lines(path: str) -> list[dict]:
    """The JSON lines of ``path`` (none if it is missing); a torn last line is skipped."""
    if not os.path.exists(path):
        return []
    out = []
    with open(path) as f:
        for line in f:
            try:
                out.append(json.loads(line))
            except json.JSONDecodeError:
                continue
    return out
