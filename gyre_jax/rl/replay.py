"""Resume by replay: the steps a rewind removed are trained again from their records, bit for bit.

A kill -9 (or a checkpoint that could not be written) rewinds a run to its last checkpoint k, but
the steps k..j-1 it had trained are not lost: the store's cursor recorded, for each, the groups it
took in the order taken, its size and mode (``TrajectoryStore.mark_step``; ``StepInput.record``).
The elastic step is a pure function of its rows (gradients summed in micro-batch order), and the
rows of a step are a function of its groups in that order, so training those groups again from
checkpoint k reaches the crashed run's versions k+1..j exactly (``params_hash`` in metrics.jsonl
shows it). Only what cannot be replayed goes to the resized steps of ``policy.resume_step_sizes``:
rollouts no step consumed, and steps past one that cannot be replayed (a record from before
records existed, a rollout the store no longer has complete).

Order at a resume (``resume_with_replay``; docs/design.md, "The resume protocol"):

1. read the plan: the cursor's step records from k on, contiguous, every rollout still complete
   (plus the plan an interrupted replay saved: ``replay_plan.json`` in the workdir);
2. save the plan (a kill during the replay finds it again), then rewind the cursor to the
   checkpoint's (``resume_store``);
3. train each planned step through the same processor and runner as a live step (the core
   alone; no rollout runs yet), each re-marked in the cursor as it was, each checkpointed when
   due; its ``StepDone`` says ``replayed``;
4. drop the saved plan; the rest of the finished rollouts are planned as before
   (``launcher.resume_plan``) at the version the replay reached.

A mismatch correction that reads behaviour-version params older than the checkpoint has them no
more (the checkpoint keeps only its own version's): such a step replays with the engine's
log-probs for those tokens, as a resume always did, and its hash can differ.
"""
from __future__ import annotations

import dataclasses
import json
import logging
import os
import time
from typing import Mapping, Sequence

from gyre_jax.rl.groups import Group
from gyre_jax.rl.step_events import StepDone
from gyre_jax.rl.step_processor import END, GROUP, STEP, StepProcessor, Taken
from gyre_jax.rl.step_runner import StepRunner
from gyre_jax.trajectory.cursor import _atomic_write_json

log = logging.getLogger(__name__)

PLAN_NAME = "replay_plan.json"


@dataclasses.dataclass(frozen=True)
class ReplayStep:
    """One recorded step to train again: its groups in the order taken, its size and mode."""

    step: int
    groups: tuple[Group, ...]
    size: int
    streamed: bool
    redate: Mapping[str, int]

    @classmethod
    def of(cls, step: int, record: Mapping) -> "ReplayStep":
        groups = tuple(Group(g["id"], int(g["version"]), list(g["rollouts"]), 0.0) for g in record["groups"])
        return cls(step, groups, int(record["size"]), bool(record["streamed"]),
                   {r: int(v) for r, v in record.get("redated", {}).items()})

    @property
    def rollouts(self) -> list[str]:
        return [r for g in self.groups for r in g.rollout_ids]


def _plan_path(workdir: str) -> str:
    return os.path.join(workdir, PLAN_NAME)


def _saved_records(workdir: str) -> dict[int, dict]:
    try:
        with open(_plan_path(workdir)) as f:
            return {int(k): v for k, v in json.load(f)["steps"].items()}
    except FileNotFoundError:
        return {}
    except (ValueError, KeyError, TypeError) as e:  # a damaged plan replays nothing: the resized steps take it
        log.warning("replay: %s is unreadable (%s); replaying only what the cursor records", _plan_path(workdir), e)
        return {}


def lost_steps(store, checkpoint_step: int, last_step: int, workdir: str) -> list[ReplayStep]:
    """The steps from ``checkpoint_step`` on (before ``last_step``) that can be replayed, read before the rewind:
    the cursor's records (this lineage's), else a saved plan's (an interrupted replay's), contiguous from the
    checkpoint, each with every rollout complete in the store and none consumed at an earlier step."""
    records, saved = store.step_records(), _saved_records(workdir)
    complete, consumed = set(store.complete_rollouts()), store.consumed()
    plan: list[ReplayStep] = []
    seen: set[str] = set()
    for step in range(checkpoint_step, last_step):
        record = records.get(step, saved.get(step))
        if record is None:
            break
        rs = ReplayStep.of(step, record)
        ids = rs.rollouts
        bad = [r for r in ids if r not in complete or r in seen or (r in consumed and consumed[r]["step"] != step)]
        if bad:
            log.warning("replay: step %d cannot be replayed (rollouts %s are not complete, or consumed elsewhere); "
                        "the steps from it on take their groups anew", step, bad[:5])
            break
        seen.update(ids)
        plan.append(rs)
    return plan


def save_plan(workdir: str, plan: Sequence[ReplayStep], records: Mapping[int, dict]) -> None:
    """The plan where a kill during the replay finds it (the rewind erases it from the cursor)."""
    if plan:
        _atomic_write_json(_plan_path(workdir), {"steps": {str(s.step): records[s.step] for s in plan}})


def drop_plan(workdir: str) -> None:
    try:
        os.unlink(_plan_path(workdir))
    except FileNotFoundError:
        pass


class _ReplayOwner:
    """The runner's owner while it replays: no queue, no dynamic sampling; the buffer is what is left."""

    def __init__(self, pending: Sequence[str], consumed):
        self._pending, self._consumed = list(pending), consumed

    def step_trained(self) -> tuple[int, float]:
        return 0, time.perf_counter()

    def step_done(self, version: int) -> None:
        pass

    def buffered_rollouts(self) -> list[str]:
        consumed = self._consumed()
        return [r for r in self._pending if r not in consumed]


def replay(plan: Sequence[ReplayStep], processor: StepProcessor, runner: StepRunner,
           pending: Sequence[str]) -> list[StepDone]:
    """Train ``plan``'s steps in order from the runner's version (module docstring); their ``StepDone``s.
    ``pending``: every finished, untrained rollout after the rewind, in order (checkpoints' buffers)."""
    runner.owner, runner.replaying = _ReplayOwner(pending, runner.store.consumed), True
    try:
        for rs in plan:
            if runner.trainer.version != rs.step:
                raise RuntimeError(f"replay: step {rs.step} planned, but the trainer is at version {runner.trainer.version}")
            t0 = time.perf_counter()
            if rs.streamed:
                for g in rs.groups:
                    processor.handle(Taken(GROUP, rs.step, (g,), size=rs.size, redate=rs.redate))
                processor.handle(Taken(END, rs.step, size=rs.size))
            else:
                processor.handle(Taken(STEP, rs.step, rs.groups, size=rs.size, redate=rs.redate))
            while runner.trainer.version == rs.step:
                runner.on_batch(next(runner.it))
            print(f"replay: step {rs.step} trained again from its record ({len(rs.groups)} groups) in "
                  f"{time.perf_counter() - t0:.1f}s", flush=True)
    finally:
        runner.owner, runner.replaying = None, False
    out = []
    while not runner.done.empty():
        out.append(runner.done.get())
    return out


@dataclasses.dataclass(frozen=True)
class Resumed:
    """A resume's outcome: where it restored, where the replay took it, and what is left to train."""

    checkpoint_step: int  # the restored checkpoint's (the first step this attempt records)
    steps_done: int  # after the replay
    ready: tuple  # launcher.Group: finished groups to train first
    short: tuple  # launcher.ResumedGroup: groups a stop cut short, their missing slots run again
    replayed: tuple[StepDone, ...]


def resume_with_replay(store, restored, *, workdir: str, run_id: str, group_size: int, last_step: int,
                       processor: StepProcessor, runner: StepRunner) -> Resumed:
    """Rewind to ``restored`` (a checkpoint), replay what can be replayed, plan the rest (module docstring)."""
    from gyre_jax.rl.checkpoint import resume_store
    from gyre_jax.rl.launcher import resume_plan

    k = restored.step
    records = {**_saved_records(workdir), **store.step_records()}
    plan = lost_steps(store, k, last_step, workdir)
    save_plan(workdir, plan, records)
    pending = resume_store(store, restored)  # the cursor as the checkpoint has it: every later step pending
    done = replay(plan, processor, runner, pending)
    drop_plan(workdir)
    steps_done = runner.trainer.version
    consumed = store.consumed()
    pending = [r for r in pending if r not in consumed]
    ready, short = resume_plan(store, run_id, group_size, steps_done, pending)
    return Resumed(k, steps_done, tuple(ready), tuple(short), tuple(done))
