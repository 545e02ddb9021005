"""The RL loop (job 'rl'): ``build(config) -> Components`` (``gyre_jax.rl.build``), then
``drive(components)``, the loop a person reads in one sitting: tick the controller,
turn each finished step into a metrics record, and stop when the last step is
trained or something fails that the run cannot survive.

Data flow of one step (docs/design.md has the picture)::

    Launch (policy: admission bounds staleness)
      -> harness group (HTTP, 127.0.0.1) -> proxy -> router -> JetStream engine (rollout cell)
      -> proxy writes each call (tokens, behavior log-probs, version) to the TrajectoryStore
      -> harness grades the workspace (subprocess), appends the RolloutOutcome
    group finished -> ready -> TakeGroups (policy) -> processor: rewards -> advantages -> trees
      -> Jmax paths -> packed rows -> RowStream -> grain StreamingDataset -> ElasticStep on the
      core + every cell in train role -> store.mark_trained -> Orbax checkpoint
      (state, data position, store cursor, buffered rollouts)
    Publish (policy, every k updates) -> WeightPublisher -> the serving cells' engines

Failure model. What can be survived is: a role switch or weight load that raises
(retried, then the cell goes out of service), a satellite that fails in a step
(its work goes to the others), an engine error on a call (the harness retries),
a grader crash (``verifier_error``, never trained), a harness group that breaks
(its rollouts become ``infra_error``). Anything else (the core's step, the
controller, a checkpoint write) ends the run: ``drive`` saves a checkpoint if the
last one is older than the trained state (the store is durable, so every finished
rollout is found again) and raises ``RunFailed`` with one line saying what failed;
rerunning the same command resumes.

Everything lives under ``<workdir>/<mode>/``: store, workspaces, checkpoints,
metrics.jsonl, timeline.png, summary.json, attempts/ (each attempt's role timeline and how it
ended, ``rl.attempts``), scheduler_costs.json (the controller's
measured costs, rewritten each step: a resumed run starts from them, and
``--config.scheduler.priors`` gives them to another run).
"""
from __future__ import annotations

import dataclasses
import json
import logging
import os
import queue
import time
import traceback

import jax

from gyre_jax.errors import RunFailed, StorageError
from gyre_jax.rl import attempts as attempts_lib
from gyre_jax.rl import task_gate
from gyre_jax.rl.build import Components, build, run_satellite
from gyre_jax.rl.config import RLConfig
from gyre_jax.rl.launcher import RolloutsFailed
from gyre_jax.rl.progress import Progress
from gyre_jax.rl.report import StepRecorder, earlier_records, run_summary, status_line, store_statuses

log = logging.getLogger(__name__)


def run(config, workdir: str) -> dict:
    """Job 'rl' (gyre_jax.jobs): the loop in ``<workdir>/<mode>``; returns the summary dict."""
    cfg = RLConfig.from_config(config)  # every bad value fails here, before any JAX work
    if jax.process_count() > 1 and jax.process_index() > 0:  # pods: a satellite cell (gyre_jax.pods.rl_job)
        return run_satellite(cfg, workdir=os.path.join(workdir, cfg.scheduler.mode))
    mode_dir = os.path.join(workdir, cfg.scheduler.mode)
    try:
        checked = task_gate.gate(cfg, workdir)  # every task's grader works, or the run stops here (one line)
        c = build(cfg, mode_dir)
    except BaseException as e:  # the attempt's record says how it ended, for the report; then the one line
        attempts_lib.record_start_failure(mode_dir, e)
        raise
    return drive(dataclasses.replace(c, task_check=checked) if checked else c)


def _errors(c: Components) -> list[tuple[str, BaseException]]:
    """Failures of background work the run cannot survive; a storage failure first (it names the path)."""
    sources = (("cells", c.pool.errors), ("trainer", c.trainer.errors), ("rollouts", c.launcher.errors),
               ("proxy", getattr(getattr(c.server, "proxy", None), "storage_errors", [])))
    found = [(what, e) for what, errs in sources for e in list(errs)]
    return sorted(found, key=lambda we: not isinstance(we[1], StorageError))


class _Records:
    """The loop's side of the trainer's ``done`` queue: each ``StepDone`` becomes a record, which the step hooks
    (``rl.hooks``: the eval, the metrics writer, ...) see in turn."""

    def __init__(self, c: Components, bar: Progress, attempt: attempts_lib.AttemptLog | None = None):
        self.c, self.bar, self.attempt = c, bar, attempt
        self.history: list = []  # StepRecords of this attempt, in step order
        self.step_end_s: list[float] = []
        self.recorder = StepRecorder(clock=c.clock, server=c.server, timeline=c.timeline, launcher=c.launcher,
                                     pool=c.pool, controller=c.controller)
        # The starting policy's eval (version steps_done) goes into the first step record of
        # this run as eval/*_start, so metrics.jsonl stays one line per step.
        self.start_eval: dict = {}
        if c.evaluator is not None:
            version, params = c.trainer.latest_params()
            self.start_eval = {k + "_start": v for k, v in c.evaluator.evaluate(version, params).items()}

    def take(self) -> None:
        c = self.c
        while True:
            try:
                done = c.trainer.done.get_nowait()
            except queue.Empty:
                return
            for cell, err in done.report.failed_cells:  # its work went to the other cells; the pool decides
                c.pool.training_failed(cell, f"training failed in step {done.step}: {err}")
            rec = self.recorder.record(done)
            if self.start_eval:
                rec, self.start_eval = rec.with_values(self.start_eval), {}
            rec = c.step_hooks.after_step(done.version, done.params, rec)
            self.step_end_s.append(rec["time_s"])
            self.history.append(rec)
            self.bar.set_status(self.status())  # before the step's line: it prints this step's reward
            self.bar.step()
            if self.attempt is not None:
                self.attempt.update(*c.timeline.snapshot(), step=rec.step, counters=attempt_counters(c))

    def status(self) -> str:
        """The progress line's status: the last trained step's reward, rollouts in flight, each cell's role."""
        c = self.c
        roles = "".join(">" if r.startswith("to") else r[0] for r in c.pool.roles())
        last = self.history[-1] if self.history else None
        reward = f"reward={last['reward']:.3f} {status_line(last)}" if last is not None else ""
        return f"{reward}in_flight={c.launcher.running_rollouts()} roles={roles}"


def drive(c: Components) -> dict:
    """Run the controller until the last step is trained; the summary dict."""
    cfg, t0 = c.cfg, time.perf_counter()
    if c.start.steps_done >= cfg.steps:  # a finished run: train nothing, keep its summary
        c.close()
        path = os.path.join(c.workdir, "summary.json")
        if os.path.exists(path):
            with open(path) as f:
                return json.load(f)
        return {"mode": cfg.scheduler.mode, "steps": 0}
    bar = Progress(total=cfg.steps, initial=c.start.steps_done, desc=f"rl[{cfg.scheduler.mode}]",
                   enabled=cfg.progress, every_s=cfg.progress_every_s)
    sft = list(c.start.sft_history)
    attempt = attempts_lib.AttemptLog(c.workdir, first_step=c.start.steps_done, n_cells=len(c.layout.cells), extra={
        "setup_s": c.start.setup_s, "sft_steps": len(sft), "sft_loss_last": sft[-1]["loss"] if sft else None})
    records = _Records(c, bar, attempt)
    failure: BaseException | None = None
    statuses = None
    evals: list[dict] = []
    try:
        while not c.controller.done():
            _raise_errors(c)
            c.controller.tick()
            records.take()
            bar.set_status(records.status())
            c.wake.wait(cfg.scheduler.poll_s)
            c.wake.clear()
        records.take()  # the last step's
        evals = c.evaluator.finish() if c.evaluator is not None else []  # background ones: waited for
    except BaseException as e:  # noqa: BLE001 - save what we can, then one clear line
        failure = e
    finally:
        bar.close()
        wall_rl = c.clock.now()
        segments = c.timeline.close()
        attempt.end(segments, wall_rl, failure, attempt_counters(c))
        if failure is not None:
            _save_after_failure(c, failure)
        else:
            statuses = store_statuses(c.store)  # every finished rollout of the run, every attempt's
        c.close()
    if failure is not None:
        _reraise(c, failure)
    injected = attempt_counters(c)["injected_faults"]
    return run_summary(cfg=cfg, workdir=c.workdir, history=records.history, evals=evals, segments=segments,
                       n_cells=len(c.layout.cells), step_end_s=records.step_end_s, wall_rl=wall_rl,
                       wall=c.start.setup_s + (time.perf_counter() - t0), launcher=c.launcher, timeline=c.timeline,
                       pool=c.pool, server=c.server, injected=injected, sft_history=sft,
                       earlier=earlier_records(c.metrics.jsonl_path, c.start.steps_done),
                       attempts=attempts_lib.read_all(c.workdir), statuses=statuses,
                       task_check=c.task_check)


def attempt_counters(c: Components) -> dict:
    """This attempt's counters that add up over a run's attempts (``rl.attempts``: the summary sums them)."""
    injected = {**(dict(c.faults.injected) if c.faults is not None else {}),
                **(dict(c.chaos.injected) if c.chaos is not None else {})}
    return {"engine_errors": int(c.server.proxy.counters.get("engine_errors", 0)),
            "retries": int(sum(r["retries"] for r in c.launcher.results)),
            "group_failures": len(c.launcher.group_failures), "rerun_rollouts": c.launcher.rerun_rollouts,
            "injected_faults": injected}


def _raise_errors(c: Components) -> None:
    """Raise the first failure of background work the run cannot survive, if any."""
    errors = _errors(c)
    if errors:
        what, e = errors[0]
        if isinstance(e, (StorageError, RunFailed)):  # they name what failed themselves
            raise e
        raise RunFailed(f"{what}: {e!r}") from e


def _reraise(c: Components, failure: BaseException) -> None:
    """The run's failure as one clear line (an interrupt as itself, a storage failure with its path)."""
    if isinstance(failure, KeyboardInterrupt):
        raise failure
    if isinstance(failure, StorageError):  # its own exit code; the message names the path
        raise StorageError(failure.path, failure.what, failure.__cause__ or failure) from failure
    if isinstance(failure, RolloutsFailed):  # nothing to resume into: the cause must be fixed first
        raise RunFailed(f"RL loop stopped at step {c.trainer.steps_done}: {failure}") from failure
    what = failure if isinstance(failure, RunFailed) else RunFailed(f"{type(failure).__name__}: {failure}")
    raise RunFailed(f"RL loop stopped at step {c.trainer.steps_done}: {what}; the last checkpoint and the "
                    f"trajectory store hold every finished rollout: rerun the same command to resume") from failure


def _save_after_failure(c: Components, failure: BaseException) -> None:
    """A checkpoint of the trained state if the last one is older (``CheckpointHook.save_after_failure``). If that
    fails too, one line says so and its traceback goes with the failure's (a note: the run's errors.log)."""
    try:
        c.checkpoints.save_after_failure(c.trainer)
    except Exception as e:  # noqa: BLE001 - the failure is what the user needs to see
        log.error("saving a checkpoint after the failure failed: %s: %s", type(e).__name__, e)
        failure.add_note("Saving a checkpoint after it failed too:\n" + "".join(traceback.format_exception(e)))
