"""The trajectory processor: finished rollouts of a step -> packed rows + stats.

    calls + outcomes --rewards--> advantages (the registered estimator; failures out of
                       training and of its statistics; optional overlong shaping)
                     --tree.build_tree--> one prefix-sharing tree per trained rollout
                     --select.select_paths--> at most Jmax paths
                     --binpack.pack_trees--> rows of row_len with loss weights (the
                       registered weight builder),
                       advantages, behavior log-probs and policy versions per token

One-step mode: call ``process_step`` once with every rollout of the step and
``RowStream.add`` its rows as one chunk (``trajectory.dataset``). Multi-step
(streaming) mode: call it once per finished group with ``num_step_rollouts`` = the
step's rollout count R (so the weights of all calls sum to 1 over the step),
``rollout_index_offset`` to keep rollout indices distinct, and ``RowStream.add``
each group's rows.

Nothing is dropped silently: failed rollouts' calls are counted per status in
``StepStats.calls_dropped``; a trained rollout whose call count disagrees with its
outcome's ``num_calls``, or calls without an outcome, are errors. What the Jmax
path budget leaves out of trained rollouts is counted too: ``trainable_dropped``
recorded output tokens (of ``trainable_unique``), ``rollouts_truncated`` rollouts,
the worst one by id and fraction (``max_dropped_rollout``, ``max_dropped_fraction``).
"""
from __future__ import annotations

import dataclasses
import logging
import time
from typing import Any, Iterable, Sequence

import numpy as np

from gyre_jax.losses import WEIGHT_BUILDERS
from gyre_jax.registry import options_field
from gyre_jax.schema import derived
from gyre_jax.trajectory.binpack import pack_trees
from gyre_jax.trajectory.node import TreeNode
from gyre_jax.trajectory.rewards import AdvantageConfig, compute_advantages
from gyre_jax.trajectory.select import SelectConfig, select_paths
from gyre_jax.trajectory.serialize import PackedRows
from gyre_jax.trajectory.tree import build_tree
from gyre_jax.trajectory.vocab import FAILURE_STATUSES, ROLE_SUBAGENT, ROLE_SUMMARY

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True, kw_only=True)
class ProcessorConfig(AdvantageConfig):
    """The rewards and advantages (``AdvantageConfig``'s fields), the paths kept and the rows packed."""

    row_len: int  # packed row length L; must cover the longest context (prompt + output)
    select: SelectConfig = SelectConfig()
    group_field: str = "group_id"  # outcome field that defines a group (rewards.py)
    min_rows: int = 0  # pad the step to at least this many rows (e.g. one batch)
    weights: str = "rollout_token_mean"  # gyre_jax.losses.WEIGHT_BUILDERS name: the loss aggregation
    weights_options: Any = options_field(WEIGHT_BUILDERS, "weights")  # its config (None: defaults)
    # An MoE model's MoE layers x top-k (ModelConfig.routing_width): rows carry recorded routing
    # [B, L, R] (-1 where none) for routing replay and its mismatch metric; 0: a dense model, no field.
    routing_width: int = derived(0, "model.routing_width")

    def __post_init__(self):
        AdvantageConfig.__post_init__(self)
        if not (isinstance(self.row_len, int) and self.row_len >= 2):
            raise ValueError(f"ProcessorConfig.row_len={self.row_len!r} must be an int >= 2")
        if not isinstance(self.select, SelectConfig):
            raise TypeError("ProcessorConfig.select must be a SelectConfig")
        if self.group_field not in ("group_id", "task_id"):
            raise ValueError(f"ProcessorConfig.group_field={self.group_field!r}; known: ('group_id', 'task_id')")
        if self.min_rows < 0:
            raise ValueError(f"ProcessorConfig.min_rows={self.min_rows} must be >= 0")


@dataclasses.dataclass(frozen=True)
class StepStats:
    rollouts: int  # outcomes given
    trained_rollouts: int  # valid (completed/timeout) rollouts; R unless num_step_rollouts is given
    failures: dict  # status -> count, for every status (completed and timeout included)
    calls: int  # call records given
    calls_dropped: dict  # failure status -> calls of those rollouts (not trained, counted)
    no_calls: int  # trained rollouts without any call record (in R, no tokens; logged)
    no_selection: int  # trained rollouts with no selected path (main_only without a main path)
    recorded_tokens: int  # sum of prompt + output tokens of the trained rollouts' calls
    unique_tokens: int  # tokens of their rebuilt trees (each shared prefix once)
    selected_tokens: int  # tokens of the selected trees
    expanded_tokens: int  # sum of the selected paths' lengths, each path expanded alone
    packed_tokens: int  # non-padding tokens in the rows (selected + copies)
    duplicated_tokens: int  # ancestor-path copies from splitting trees larger than a row
    branch_copies: int  # branch-point copies (serialize.py's rule)
    trainable_targets: int  # positions with a loss (each unique trainable token once)
    paths_total: int  # root-to-leaf paths of the trained rollouts' rebuilt trees
    paths_selected: int  # paths kept by select (at most Jmax per rollout)
    # What path selection cost (each unique trainable token once, as in trainable_targets):
    trainable_unique: int  # trainable tokens of the rebuilt trees
    trainable_selected: int  # of those, in the selected paths (what packing trains on)
    trainable_dropped: int  # trainable_unique - trainable_selected: recorded outputs not trained
    rollouts_truncated: int  # trained rollouts that lost at least one trainable token to selection
    max_dropped_fraction: float  # worst rollout's dropped / its trainable tokens (0.0 if none lost)
    max_dropped_rollout: str | None  # that rollout's id (None if none lost)
    rows: int
    fill: float  # packed_tokens / (rows * row_len)
    seconds: dict  # phase -> wall seconds ('rebuild', 'select', 'pack', 'total')
    # The aggregation's normaliser: units (rollouts or tokens) in these rows, and what the
    # weights were divided by (a streamed step is rescaled by normalizer / its units' sum).
    # What the trees did (trained rollouts): the shapes that make packing a tree once pay off.
    branching_rollouts: int = 0  # rebuilt trees with more than one root-to-leaf path
    branch_points: int = 0  # tree nodes with more than one child
    compaction_calls: int = 0  # calls of role 'summary' (a context compacted)
    subagent_calls: int = 0  # calls of role 'subagent'
    retried_calls: int = 0  # calls whose prompt repeats the same agent's previous prompt (a retry or resample)
    weight_units: float = 0.0
    weight_normalizer: float = 0.0
    advantage_metrics: dict = dataclasses.field(default_factory=dict)  # the estimator's (counts)

    @property
    def dedup_factor(self) -> float:
        """Training tokens saved by prefix sharing: expanded paths / packed tokens."""
        return self.expanded_tokens / self.packed_tokens if self.packed_tokens else 0.0

    @property
    def packed_over_unique(self) -> float:
        return self.packed_tokens / self.selected_tokens if self.selected_tokens else 0.0

    def as_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d.update(dedup_factor=self.dedup_factor, packed_over_unique=self.packed_over_unique)
        return d


@dataclasses.dataclass
class StepBatch:
    rows: PackedRows  # [B, L], loss_weights and advantages filled
    rollout_index: np.ndarray  # int32[B, L]: index into rollout_ids (+ offset), -1 on padding
    rollout_ids: tuple  # trained rollouts, in the order given
    advantages: np.ndarray  # float32[len(rollout_ids)]
    stats: StepStats


def _group_calls(calls: Iterable[Any]) -> dict[str, list]:
    by_rollout: dict[str, list] = {}
    for c in calls:
        by_rollout.setdefault(c.rollout_id, []).append(c)
    return by_rollout


def process_step(
    calls: Iterable[Any],
    outcomes: Sequence[Any],
    config: ProcessorConfig,
    *,
    num_step_rollouts: int | None = None,
    rollout_index_offset: int = 0,
) -> StepBatch:
    """Process the finished rollouts of one step (or one group of it, streaming).

    ``calls``: ``ModelCallRecord``s of these rollouts (any order). ``outcomes``:
    one ``RolloutOutcome`` per rollout. Rollouts are kept in the outcomes' order.
    """
    t0 = time.perf_counter()
    by_rollout = _group_calls(calls)
    known = {o.rollout_id for o in outcomes}
    orphans = sorted(set(by_rollout) - known)
    if orphans:
        raise ValueError(
            f"process_step: calls for {len(orphans)} rollout(s) without an outcome "
            f"(not finished? pass only finished rollouts): {orphans[:5]}"
        )
    lengths = None
    if config.overlong:  # DAPO's overlong shaping reads each rollout's generated tokens
        lengths = [sum(int(c.output_ids.shape[0]) for c in by_rollout.get(o.rollout_id, [])) for o in outcomes]
    rew = compute_advantages(outcomes, config, group_field=config.group_field, lengths=lengths)
    trained, adv, calls_dropped = _trained_rollouts(outcomes, rew, by_rollout)
    t1 = time.perf_counter()
    trees, recorded, no_calls = _build_trees(trained)
    t2 = time.perf_counter()
    sels = [select_paths(t, config.select) if t is not None else None for t in trees]
    t3 = time.perf_counter()
    pack = pack_trees(
        [s.tree if s is not None else None for s in sels],
        np.asarray(adv, np.float32),
        config.row_len,
        num_step_rollouts=num_step_rollouts,
        names=[f"rollout {rid!r}" for rid, _ in trained],
        min_rows=config.min_rows,
        weights=config.weights,
        weights_config=config.weights_options,
        routing_width=config.routing_width,
    )
    t4 = time.perf_counter()
    ri = pack.rollout_index
    if rollout_index_offset:
        ri = np.where(ri >= 0, ri + rollout_index_offset, -1).astype(np.int32)
    counts = dict(rollouts=len(outcomes), trained_rollouts=len(trained), failures=dict(rew.counts),
                  calls=sum(len(v) for v in by_rollout.values()), calls_dropped=calls_dropped, no_calls=len(no_calls),
                  recorded_tokens=recorded, advantage_metrics=dict(rew.metrics),
                  seconds={"rebuild": t2 - t1, "select": t3 - t2, "pack": t4 - t3, "total": t4 - t0})
    return StepBatch(
        rows=pack.rows,
        rollout_index=ri,
        rollout_ids=tuple(rid for rid, _ in trained),
        advantages=np.asarray(adv, np.float32).reshape(-1),
        stats=_step_stats(trained, trees, sels, pack, counts),
    )


def _trained_rollouts(outcomes: Sequence[Any], rew, by_rollout: dict[str, list]) -> tuple[list, list, dict[str, int]]:
    """([(rollout id, its calls)] of the valid rollouts, their advantages, calls dropped per failure
    status); a valid rollout's calls must be as many as its outcome says."""
    calls_dropped = {s: 0 for s in FAILURE_STATUSES}
    trained, adv = [], []
    for o, valid, a in zip(outcomes, rew.valid, rew.advantages):
        cs = by_rollout.get(o.rollout_id, [])
        if not valid:
            calls_dropped[o.status] += len(cs)
            continue
        expected = getattr(o, "num_calls", None)
        if expected is not None and expected != len(cs):
            raise ValueError(
                f"process_step: rollout {o.rollout_id!r}: outcome says {expected} calls, "
                f"{len(cs)} call records given (records lost or duplicated)"
            )
        trained.append((o.rollout_id, cs))
        adv.append(a)
    if any(calls_dropped.values()):
        log.info("process_step: dropped calls of failed rollouts (not trained): %s", calls_dropped)
    return trained, adv, calls_dropped


def _build_trees(trained: list) -> tuple[list[TreeNode | None], int, list[str]]:
    """(each trained rollout's rebuilt tree: None if it never called the model, recorded tokens,
    the rollouts without calls: in R, no tokens)."""
    recorded = 0
    trees: list[TreeNode | None] = []
    no_calls = []
    for rid, cs in trained:
        recorded += sum(int(c.prompt_ids.shape[0] + c.output_ids.shape[0]) for c in cs)
        if not cs:
            no_calls.append(rid)
            trees.append(None)
            continue
        trees.append(build_tree(cs))
    if no_calls:
        log.warning("process_step: %d trained rollout(s) have no call records: %s", len(no_calls), no_calls[:5])
    return trees, recorded, no_calls


def _step_stats(trained: list, trees: list, sels: list, pack, counts: dict) -> StepStats:
    """The step's StepStats from its trees, selections and packing (``counts``: the fields counted before)."""
    # Per rollout: fraction of its trainable tokens that selection left out.
    lost = [((s.trainable_total - s.trainable_kept) / s.trainable_total, rid)
            for (rid, _), s in zip(trained, sels) if s is not None and s.trainable_kept < s.trainable_total]
    worst = max(lost, key=lambda x: x[0], default=(0.0, None))
    sel = [s for s in sels if s is not None]
    counted: dict[str, Any] = {**tree_shape_counts([cs for _, cs in trained], trees), **counts}
    return StepStats(
        **counted,
        no_selection=sum(s.tree is None for s in sel),
        unique_tokens=sum(s.tokens_total for s in sel),
        selected_tokens=pack.unique_tokens,
        expanded_tokens=sum(s.expanded_tokens for s in sel),
        packed_tokens=pack.packed_tokens,
        duplicated_tokens=pack.duplicated_tokens,
        branch_copies=pack.branch_copies,
        trainable_targets=int(pack.num_targets.sum()),
        paths_total=sum(s.paths_total for s in sel),
        paths_selected=sum(s.paths_selected for s in sel),
        trainable_unique=sum(s.trainable_total for s in sel),
        trainable_selected=sum(s.trainable_kept for s in sel),
        trainable_dropped=sum(s.trainable_total - s.trainable_kept for s in sel),
        rollouts_truncated=len(lost),
        max_dropped_fraction=worst[0],
        max_dropped_rollout=worst[1],
        rows=int(pack.rows.tokens.shape[0]),
        fill=pack.fill,
        weight_units=pack.weight_units,
        weight_normalizer=pack.weight_normalizer,
    )


def tree_shape_counts(calls_per_rollout, trees) -> dict[str, int]:
    """Branching, compaction, sub-agent and retry counts of rollouts (their calls and rebuilt trees)."""
    out = dict(branching_rollouts=0, branch_points=0, compaction_calls=0, subagent_calls=0, retried_calls=0)
    for cs, tree in zip(calls_per_rollout, trees):
        if tree is not None:
            forks = sum(len(n.children) > 1 for n in tree.walk())
            out["branch_points"] += forks
            out["branching_rollouts"] += forks > 0
        last_prompt: dict[int, np.ndarray] = {}
        for c in sorted(cs, key=lambda c: c.call_index):
            out["compaction_calls"] += c.role == ROLE_SUMMARY
            out["subagent_calls"] += c.role == ROLE_SUBAGENT
            prev = last_prompt.get(c.agent_id)
            out["retried_calls"] += prev is not None and np.array_equal(prev, c.prompt_ids)
            last_prompt[c.agent_id] = c.prompt_ids
    return {k: int(v) for k, v in out.items()}
