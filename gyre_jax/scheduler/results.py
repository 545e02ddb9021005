"""What a simulation returns, and the makespan lower bound it is judged against."""
from __future__ import annotations

import dataclasses

import numpy as np

from gyre_jax.scheduler.controller import Decision
from gyre_jax.scheduler.vocab import ROLLOUT, TO_ROLLOUT, TO_TRAIN, TRAIN, TRAIN_IDLE
from gyre_jax.scheduler.workloads import Rollouts, SimConfig

STATES = (ROLLOUT, TRAIN, TRAIN_IDLE, TO_TRAIN, TO_ROLLOUT)  # timeline states of a cell


@dataclasses.dataclass(frozen=True)
class SimResult:
    config: SimConfig
    makespan_s: float
    step_end_s: tuple[float, ...]
    staleness_mean: float  # over rollouts
    staleness_max: int
    switches: int
    truncated_rollouts: int  # hit the harness deadline (graded, trained on)
    moved_calls: int  # in-flight calls moved off a drained cell
    rollouts_trained: int
    state_time_s: dict[str, float]  # cell-seconds in each timeline state
    serving_slot_s: float  # slot-seconds of model calls served
    train_work_s: float  # cell-seconds of training computed
    lower_bound_s: float
    lower_bound_kind: str  # 'work' or 'critical_path'
    segments: tuple[tuple[int, float, float, str], ...]  # (cell, t0, t1, state)
    series: tuple[tuple[float, int, int, int, int], ...]  # (t, running rollouts, active calls, queued, train cells)
    decisions: tuple[Decision, ...]
    events: int
    wall_s: float
    cpu_s: float  # process CPU time (wall_s also counts other jobs sharing the machine)

    @property
    def n_cells(self) -> int:
        return self.config.cluster.n_cells

    def utilization(self) -> dict[str, float]:
        """Fractions of accelerator-time (cells x makespan)."""
        total = self.n_cells * self.makespan_s
        st = self.state_time_s
        rollout_t = st[ROLLOUT]
        train_t = st[TRAIN] + st[TRAIN_IDLE]
        serve_busy = self.serving_slot_s / self.config.cluster.slots_per_cell
        return {
            "rollout_role": rollout_t / total,
            "train_role": train_t / total,
            "switching": (st[TO_TRAIN] + st[TO_ROLLOUT]) / total,
            "serving_busy": serve_busy / total,  # slot occupancy, in cells
            "training_busy": self.train_work_s / total,
            "busy": (serve_busy + self.train_work_s) / total,
        }

    def summary(self) -> dict:
        u = self.utilization()
        return {
            "mode": self.config.policy.mode,
            "makespan_h": self.makespan_s / 3600,
            "lower_bound_h": self.lower_bound_s / 3600,
            "over_lower_bound": self.makespan_s / self.lower_bound_s,
            "staleness_mean": self.staleness_mean,
            "staleness_max": self.staleness_max,
            "switches": self.switches,
            "truncated_rollouts": self.truncated_rollouts,
            **{f"util_{k}": v for k, v in u.items()},
            "events": self.events,
            "wall_s": self.wall_s,
            "cpu_s": self.cpu_s,
        }


def lower_bound(config: SimConfig, rollouts: Rollouts, serving_slot_s: float, train_work_s: float) -> tuple[float, str]:
    """Makespan with perfect utilization, and a critical path; the larger is a lower bound.

    work: (served slot-seconds / slots + training cell-seconds + one optimizer update per
    step on one cell) / cells. critical path: the longest rollout run alone (no queueing,
    cut at its deadline), then its group trained on every cell, then the update.
    """
    cl, w, p = config.cluster, config.workload, config.policy
    n = cl.n_cells
    work = (serving_slot_s / cl.slots_per_cell + train_work_s + p.total_steps * w.optimizer_s) / n
    starts = np.asarray(rollouts.offsets[:-1])
    last = np.asarray(rollouts.offsets[1:]) - 1
    tool = np.asarray(rollouts.tool_s)
    dur = np.add.reduceat(np.asarray(rollouts.call_s) + tool, starts) - tool[last]  # no tool after the last call
    crit = float(np.minimum(dur, w.rollout_timeout_s).max()) + w.optimizer_s
    return (work, "work") if work >= crit else (crit, "critical_path")


