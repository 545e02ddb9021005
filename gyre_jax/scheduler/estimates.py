"""Online estimates: what the controller measures instead of taking it on faith.

The policy needs four costs it cannot know in advance: how many slots a running agent
keeps busy (``serve_reserve``), what a role switch costs, and the serving and training
cell-seconds a rollout costs (which set the steady-state split). The ``Controller`` feeds
this class what it observes each tick and the actions it applies; the policy reads the
result as ``ClusterState.measured``. The same code runs in the simulator and in the RL
loop, so the simulator predicts the controller that runs.

Tick-rate independence. The simulator ticks only when something the policy reads
changed; the RL loop (and the fakes in tests) tick far more often. So that both measure
the same thing, the load (calls in flight and queued, running agents) is sampled on a
fixed grid, every ``sample_s`` seconds (the simulator schedules a tick there; the loop
polls far more often): regular samples of a load give its time average. Switch
and update durations are timed from the tick that issued them to the tick that saw
them done. What is learnt after a tick's actions (a load sample, the work of groups just
taken) becomes visible at the next such instant, not at the next tick, for the same reason.

Drift. Rollouts grow as the policy learns, so old samples age out: every optimizer
step multiplies the accumulated sums by ``decay`` (a window of about five steps, in
steps rather than seconds so that it fits runs of minutes and runs of days alike).
"""
from __future__ import annotations

import dataclasses
import math

from gyre_jax.scheduler.policy import NOT_MEASURED, Measured, filled
from gyre_jax.scheduler.vocab import ROLLOUT, TRAIN


class OnlineEstimates:
    def __init__(self, *, group_size: int, slots_per_cell: int, sample_s: float = 5.0, decay: float = 0.8):
        self.group_size = group_size
        self.slots = max(1, slots_per_cell)
        self.decay = decay
        # One sample of the proxy's load reads every cell; every 5 s it is cheap at any
        # scale, and short against model calls of seconds to minutes.
        self.sample_s = sample_s
        self._next_sample = 0.0
        self._running_now = 0.0
        self._finished_at_sample = 0
        self._t_sample: float | None = None
        self._last = (0.0, 0.0)  # (calls in flight + queued, running agents) at the last sample
        self._calls_dt = self._running_dt = self._active_dt = 0.0  # time integrals
        self._active_last = 0.0
        self._finished = 0.0  # decayed count of finished rollouts (since the first sample)
        self._work = self._work_rollouts = 0.0  # decayed training work of taken groups / their rollouts
        self._switch_s: dict[str, float] = {}  # the role switched to (vocab.TRAIN / ROLLOUT) -> mean seconds
        self._switch_n: dict[str, int] = {}
        self._update_s: float | None = None
        self._update_t0: float | None = None
        self._steps = 0
        self._measured = Measured()
        self._restored = NOT_MEASURED  # an earlier attempt's costs, until measured again (restore)
        self._dirty = False
        self._now = 0.0
        self._switch_since: float | None = None

    # ---- inputs
    def on_tick(self, now: float, *, finished: int, steps_done: int, update_in_progress: bool,
                switch_since: float | None = None) -> bool:
        """Start of a tick. `finished`: rollouts finished since the start. `switch_since`: when
        the oldest switch still in progress was asked for (None: none is). True: take a
        load sample (``sample``) once this tick's actions are applied."""
        self._now = now
        if switch_since != self._switch_since:
            self._switch_since = switch_since
            self._dirty = True
        if steps_done > self._steps:
            f = self.decay ** (steps_done - self._steps)
            self._calls_dt *= f
            self._running_dt *= f
            self._active_dt *= f
            self._finished *= f
            self._work *= f
            self._work_rollouts *= f
            self._steps = steps_done
            self._dirty = True
        if update_in_progress and self._update_t0 is None:
            self._update_t0 = now
        elif not update_in_progress and self._update_t0 is not None:
            self._update_s = self._mean(self._update_s, now - self._update_t0, 0.3)
            self._update_t0 = None
            self._dirty = True
        due = now >= self._next_sample
        if self._dirty or due:
            self._refresh()
        return due

    def sample(self, now: float, *, finished: int, in_flight: int, queued: int, running: int) -> None:
        """The load after this tick's actions; it stands for the time until the next sample."""
        if self._t_sample is not None:
            dt = now - self._t_sample
            self._calls_dt += self._last[0] * dt
            self._running_dt += self._last[1] * dt
            self._active_dt += self._active_last * dt
            self._finished += finished - self._finished_at_sample
        self._t_sample, self._finished_at_sample = now, finished
        self._next_sample = (math.floor(now / self.sample_s) + 1) * self.sample_s
        self._running_now = float(running)
        self._last = (float(in_flight + queued), float(running))
        self._active_last = float(in_flight)

    def on_update_started(self, now: float) -> None:
        """A step's last groups were taken with nothing left to compute: the update began now."""
        if self._update_t0 is None:
            self._update_t0 = now

    def on_taken(self, groups_work_s: float, n_groups: int) -> None:
        """Groups entered a step: their training work is the measured cost per rollout."""
        self._work += groups_work_s
        self._work_rollouts += n_groups * self.group_size

    def on_switch_done(self, kind: str, seconds: float) -> None:
        n = self._switch_n.get(kind, 0) + 1
        self._switch_n[kind] = n
        old = self._switch_s.get(kind, 0.0)
        self._switch_s[kind] = old + (seconds - old) / n
        self._dirty = True

    def restore(self, costs: Measured) -> None:
        """A resumed run's own costs (costs_file): each stands until this attempt has measured
        it anew, so a resumed run does not start unmeasured (core alone, switches taken for
        free). A switch in flight then is not one now."""
        self._restored = dataclasses.replace(costs, switch_in_flight_s=None)
        self._measured = filled(self._measured, self._restored)

    # ---- output
    def measured(self) -> Measured:
        return self._measured

    def _refresh(self):
        self._dirty = False
        share = self._calls_dt / self._running_dt if self._running_dt > 0 else None
        # served slot time includes the part done by agents still running: count each as
        # half a rollout (on average halfway), so the estimate is fair from the start.
        done = self._finished + 0.5 * self._running_now
        serve = self._active_dt / self.slots / done if done > 0 and self._active_dt > 0 else None
        work = self._work / self._work_rollouts if self._work_rollouts > 0 else None
        # A round trip is measured once both directions are timed. One direction alone is only
        # a lower bound: taken for the round trip, a 30 s move back would replace a pilot's (or
        # an earlier attempt's) 90 s round trip and make switches look three times cheaper.
        legs = sum(self._switch_s.values()) if self._switch_s else None
        rt = legs if len(self._switch_s) == 2 else None
        # (refreshed on the sampling grid like the load: a lower bound need not be exact)
        in_flight = None if self._switch_since is None else self._now - self._switch_since
        bound = max((b for b in (in_flight, None if rt is not None else legs) if b is not None), default=None)
        self._measured = filled(Measured(call_share=share, serve_s_per_rollout=serve, work_s_per_rollout=work,
                                         switch_round_trip_s=rt, update_s=self._update_s,
                                         switch_to_train_s=self._switch_s.get(TRAIN),
                                         switch_to_rollout_s=self._switch_s.get(ROLLOUT),
                                         switch_in_flight_s=bound), self._restored)

    @staticmethod
    def _mean(old, new, w):
        return new if old is None else (1 - w) * old + w * new
