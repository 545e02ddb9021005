"""One rollout as the run report shows it: its calls, its tree, what was selected and trained.

Everything about the tree comes from the trainer's own code, run again on the stored records:
``trajectory.tree.rebuild`` (the exact prefix-sharing tree and each call's end node) and
``trajectory.select.select_paths`` with the run's selection config (``SelectionResult.kept``: the
nodes it trains). Advantages come from ``trajectory.rewards.compute_advantages`` over the rollouts the
step trained together (``step_advantages``). What is added here is for reading: each node decoded
into role-tagged pieces (``report.decode``), each call's completion parsed by the tokenizer's own
parser, and each call's relation to its agent's previous call (why the tree branches there):

  start       the main agent's first call
  continue    its prompt extends the previous call's prompt + output (the common, linear case)
  retry       the same prompt again (a failed or resampled call): a branch after the prompt
  drift       the prompt re-renders the previous output with other tokens: a branch inside it
  summary     a compaction call (role ``summary``)
  compacted   the first call after a summary: a new context sharing only its start with the old one
  rewrite     any other context the harness rebuilt (history edited, truncated)
  subagent    a sub-agent's first call (its own context)
"""
from __future__ import annotations

import dataclasses
import logging
import re
from typing import Any, Mapping, Sequence

import numpy as np

from gyre_jax.report.decode import DecodeState, TurnDecoder, completion
from gyre_jax.trajectory.rewards import AdvantageConfig, compute_advantages
from gyre_jax.trajectory.select import SelectConfig, select_paths
from gyre_jax.trajectory.tree import rebuild
from gyre_jax.trajectory.vocab import ROLE_SUBAGENT, ROLE_SUMMARY, SCORED_STATUSES

LOG_BYTES = 4096  # of a failed rollout's harness log kept in its detail (its start and end)
REASON_CHARS = 160

# One row of the page's rollout table, in this order (``index_row``).
INDEX_COLUMNS = ("id", "task", "group", "status", "score", "advantage", "step", "state", "version_min",
                 "version_max", "staleness", "calls", "recorded_tokens", "unique_tokens", "trained_tokens",
                 "paths", "paths_kept", "branch_points", "subagents", "compactions", "retries", "drifts", "reason",
                 "shard", "t_end")


@dataclasses.dataclass(frozen=True)
class Trained:
    """What the store's cursor says the trainer did with a rollout."""

    state: str  # trained | dropped | pending (finished, not taken yet) | running (no outcome yet)
    step: int | None = None
    reason: str | None = None  # why it was dropped


def reason_of(outcome) -> str | None:
    """Why a rollout failed (or scored 0 without a plain verdict), shortened so that equal causes group
    together: the outcome's own ``reason`` where the runner gave one (a few words, the same for the same
    cause), else the first line of its error, numbers and hex ids replaced; None for an ordinary grade."""
    if outcome is None:
        return None
    details = outcome.details or {}
    if details.get("reason"):
        text = str(details["reason"])
    elif outcome.status in SCORED_STATUSES:
        return "tampering with the test run" if (details.get("grader") or {}).get("tampered") else None
    else:
        text = str(details.get("error") or outcome.status)
    line = next((ln.strip() for ln in text.splitlines() if ln.strip()), outcome.status)
    line = re.sub(r"0x[0-9a-fA-F]+|\b[0-9a-f]{8,}\b", "<id>", line)
    line = re.sub(r"\d+(\.\d+)?", "N", line)
    return line[:REASON_CHARS]


def step_advantages(outcomes: Sequence[Any], config: AdvantageConfig, group_field: str) -> dict[str, float]:
    """rollout id -> advantage, over the outcomes one step trained (every scope of estimator gets what it
    normalises over: a group estimator its groups, a step estimator the step)."""
    if not outcomes:
        return {}
    quiet = logging.getLogger("gyre_jax.trajectory.rewards")  # its per-step INFO line, once per step of the run
    level = quiet.level
    quiet.setLevel(logging.WARNING)
    try:
        res = compute_advantages(list(outcomes), config, group_field=group_field)
    finally:
        quiet.setLevel(level)
    return {o.rollout_id: float(a) for o, a, ok in zip(outcomes, res.advantages, res.valid) if ok}


def _lcp(a: np.ndarray, b: np.ndarray) -> int:
    m = min(a.shape[0], b.shape[0])
    d = np.flatnonzero(a[:m] != b[:m])
    return int(d[0]) if d.shape[0] else m


RECENT = 8  # earlier calls of an agent a call is compared with (drift re-renders a recent output)


def call_kinds(calls) -> list[tuple[str, int]]:
    """(kind, prompt tokens shared with the agent's earlier calls) per call (module docstring).

    A call is compared with its agent's last ``RECENT`` calls; the one it shares the longest prefix
    with says why it is where it is: the same prompt (retry), all of that call's prompt and output
    (continue), a divergence inside its output (drift: a re-rendered output), or inside its prompt
    (a context rebuilt: after a summary call, compacted)."""
    recent: dict[int, list] = {}
    out = []
    for c in calls:
        earlier = recent.setdefault(c.agent_id, [])
        last = earlier[-1] if earlier else None
        if last is not None and c.role != ROLE_SUMMARY and c.prompt_ids.shape[0] >= last.sequence.shape[0] \
                and _lcp(c.prompt_ids, last.sequence) == last.sequence.shape[0]:  # the common case, in one compare
            out.append(("continue", int(last.sequence.shape[0])))
            earlier.append(c)
            del earlier[:-RECENT]
            continue
        lcps = [(_lcp(c.prompt_ids, p.sequence), p) for p in earlier]
        best = max((n for n, _ in lcps), default=0)
        near = [p for n, p in lcps if n == best]
        if c.role == ROLE_SUMMARY:
            kind = "summary"
        elif not earlier:
            kind = "subagent" if c.role == ROLE_SUBAGENT else "start"
        elif any(np.array_equal(c.prompt_ids, p.prompt_ids) for p in near):
            kind = "retry"
        elif any(best >= p.sequence.shape[0] for p in near):
            kind = "continue"
        elif any(p.prompt_ids.shape[0] <= best for p in near):
            kind = "drift"
        else:
            kind = "compacted" if earlier[-1].role == ROLE_SUMMARY else "rewrite"
        out.append((kind, best))
        earlier.append(c)
        del earlier[:-RECENT]
    return out


def _log(outcome, read_log) -> dict | None:
    """A failed (or any) rollout's harness output: the log file's start and end, else the outcome's tail."""
    h = (outcome.details or {}).get("harness") or {}
    path, tail = h.get("log_path") or "", h.get("output_tail") or ""
    text = read_log(path) if path else None
    if text is None and not tail:
        grader = (outcome.details or {}).get("grader") or {}
        out = grader.get("output_tail") or grader.get("output") or ""
        return {"source": "grader output", "text": str(out)[-LOG_BYTES:]} if out else None
    return {"source": path or "the outcome's output tail", "text": text if text is not None else tail}


def rollout_detail(rid: str, calls: Sequence[Any], outcome, *, trained: Trained, advantage: float | None,
                   decoder: TurnDecoder, select: SelectConfig, read_log, shard: str) -> tuple[dict, list]:
    """(the rollout's detail for the viewer, its row of ``INDEX_COLUMNS``)."""
    calls = sorted(calls, key=lambda c: c.call_index)
    versions = sorted({c.policy_version for c in calls}) or sorted(getattr(outcome, "policy_versions", ()) or ())
    detail: dict[str, Any] = {"id": rid, "shard": shard, "state": trained.state, "step": trained.step,
                              "dropped_reason": trained.reason, "advantage": advantage, "versions": versions}
    if outcome is not None:
        detail.update(task=outcome.task_id, group=outcome.group_id, status=outcome.status, score=outcome.score,
                      details=outcome.details, num_calls=outcome.num_calls, t_end=outcome.t_end,
                      reason=reason_of(outcome), log=_log(outcome, read_log))
    elif calls:
        detail.update(task=calls[0].task_id, group=calls[0].group_id, status="running", score=None, details={},
                      reason=None, log=None)
    tree = _tree(calls, outcome, trained, decoder, select) if calls else None
    detail["tree"] = tree
    kinds = call_kinds(calls)
    detail["calls"] = [{
        "i": c.call_index, "agent": c.agent_id, "parent": c.parent_agent_id, "role": c.role, "version": c.policy_version,
        "t_start": c.t_start, "t_end": c.t_end, "finish": c.finish_reason, "prompt_tokens": int(c.prompt_ids.shape[0]),
        "output_tokens": int(c.output_ids.shape[0]), "kind": kind, "shared": lcp,
        "end": tree["end_nodes"][str(c.call_index)] if tree else None,
        "logprob_mean": float(c.output_logprobs.mean()) if c.output_logprobs.shape[0] else None,
        "completion": completion(decoder.tok, c.output_ids)} for c, (kind, lcp) in zip(calls, kinds)]
    counts = {k: sum(kd == k for kd, _ in kinds) for k in ("retry", "drift", "summary", "subagent")}
    stale = (trained.step - versions[0]) if trained.step is not None and versions else None
    detail["staleness"] = stale
    st = (tree or {}).get("stats", {})
    row = [rid, detail.get("task"), detail.get("group"), detail.get("status"), detail.get("score"), advantage,
           trained.step, trained.state, versions[0] if versions else None, versions[-1] if versions else None, stale,
           len(calls), st.get("recorded_tokens", 0), st.get("unique_tokens", 0), st.get("trainable_kept", 0),
           st.get("paths_total", 0), st.get("paths_selected", 0), st.get("branch_points", 0), counts["subagent"],
           counts["summary"], counts["retry"], counts["drift"], detail.get("reason"), shard, detail.get("t_end")]
    return detail, row


def outcome_row(rid: str, outcome, trained: Trained, advantage: float | None, shard: str) -> list:
    """A rollout's row of ``INDEX_COLUMNS`` from its outcome alone (no call read): what the table shows while
    its group's file is built; the tree's columns (tokens, paths, branches) are None until then."""
    versions = sorted(getattr(outcome, "policy_versions", ()) or ())
    stale = (trained.step - versions[0]) if trained.step is not None and versions else None
    return [rid, getattr(outcome, "task_id", None), getattr(outcome, "group_id", None),
            outcome.status if outcome is not None else "running", getattr(outcome, "score", None), advantage,
            trained.step, trained.state, versions[0] if versions else None, versions[-1] if versions else None, stale,
            getattr(outcome, "num_calls", None), None, None, None, None, None, None, None, None, None, None,
            reason_of(outcome), shard, getattr(outcome, "t_end", None)]


def _tree(calls, outcome, trained: Trained, decoder: TurnDecoder, select: SelectConfig) -> dict:
    rebuilt = rebuild(calls)
    nodes, parent = rebuilt.root.preorder()
    index = {id(n): i for i, n in enumerate(nodes)}
    trains = outcome is not None and outcome.status in SCORED_STATUSES and trained.state != "dropped"
    sel = select_paths(rebuilt.root, select) if trains else None
    kept = set(sel.kept) if sel is not None else set()
    # Each node starts decoding where its parent ended; preorder visits parents first.
    states: list[DecodeState] = [DecodeState()] * len(nodes)
    first_call = [min(n.call_ids) if n.call_ids else -1 for n in nodes]
    for i in range(len(nodes) - 1, 0, -1):  # a subtree's first call: the lowest call id below it
        p = int(parent[i])
        if first_call[i] >= 0 and (first_call[p] < 0 or first_call[i] < first_call[p]):
            first_call[p] = first_call[i]
    out_nodes = []
    for i, n in enumerate(nodes):
        p = int(parent[i])
        pieces, states[i] = decoder.pieces(n.tokens, states[p] if p >= 0 else DecodeState())
        ntr = int(np.count_nonzero(n.trainable))
        out_nodes.append({"p": p, "n": int(n.tokens.shape[0]), "trainable": ntr, "role": n.role, "agent": n.agent_id,
                          "version": n.policy_version, "calls": list(n.call_ids), "first": first_call[i],
                          "kept": i in kept, "stale": (trained.step - n.policy_version
                                                       if i in kept and ntr and trained.step is not None else None),
                          "pieces": pieces})
    branch_points = sum(len(n.children) > 1 for n in nodes)
    stats: dict[str, Any] = {"recorded_tokens": rebuilt.recorded_tokens, "unique_tokens": rebuilt.unique_tokens,
             "trainable_tokens": rebuilt.trainable_tokens, "branch_points": branch_points,
             "paths_total": sum(not n.children for n in nodes)}
    if sel is not None:
        stats.update(paths_selected=sel.paths_selected, selected_roles=list(sel.selected_roles),
                     trainable_kept=sel.trainable_kept, tokens_kept=sel.tokens_kept, expanded_tokens=sel.expanded_tokens)
    return {"nodes": out_nodes, "end_nodes": {str(k): index[id(v)] for k, v in rebuilt.end_nodes.items()},
            "stats": stats, "trained": sel is not None}


def index_dict(row: Sequence) -> Mapping[str, Any]:
    return dict(zip(INDEX_COLUMNS, row))
