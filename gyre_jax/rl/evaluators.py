"""The held-out eval the loop runs (``config.eval``): one ``Evaluator`` interface, two kinds.

``kind=episodes`` (``episode_eval.EpisodeEval`` on a ``BackgroundEval`` thread): whole episodes
through the run's own harness on a dedicated engine; mean score, pass@1, pass@k, results as they
finish (``eval/eval.jsonl``). ``kind=first_call`` (``evaluate.HeldOutEval``, wrapped here as
``FirstCallEvaluator``): the built-in agent's FIRST model call only, in the loop's thread (~2 s for
the demo), its metrics in the step's own record.

The loop asks every evaluator the same four things (the eval hook, ``gyre_jax.rl.hooks``):
``start(resume_step)`` once the train state is known, ``evaluate(version, params)`` (metrics for the
step record now, or {} when it runs in the background), ``finish()`` (every result of this attempt,
oldest version first) and ``close()``.
"""
from __future__ import annotations

import dataclasses
import logging
import os
import time
from typing import Any, Callable, ClassVar, Protocol

from gyre_jax.errors import ConfigError
from gyre_jax.schema import check_positive

log = logging.getLogger(__name__)
EVAL_KINDS = ("episodes", "first_call")


@dataclasses.dataclass(frozen=True, kw_only=True)
class EvalConfig:
    """Held-out eval of fixed tasks at a fixed policy version and fixed sampling seeds (module docstring)."""

    SECTION: ClassVar[str] = "eval"
    every: int = 10  # evaluate after every k-th step (and before the first, after the last); 0 = off
    kind: str = "first_call"  # episodes | first_call
    tasks: int = 32  # held-out tasks (a family's seeds 2**29 + s; a task file's split=eval lines)
    samples_per_task: int = 8  # k of pass@k
    temperature: float = 1.0  # 0 = greedy; default = the harness's rollout temperature
    pass_score: float = 1.0  # an episode scoring at least this counts as passed (pass@k)
    # kind=episodes: each episode's deadline is harness.deadline_s times this. An eval scores the policy;
    # the run's own rollouts and training load the machine beside it, and an episode that misses the
    # rollouts' deadline for that reason must not score as the policy's timeout (eval_timeouts still counts).
    deadline_scale: float = 4.0

    def __post_init__(self):
        check_positive(self, ("every",), allow_zero=True)
        check_positive(self, ("tasks", "samples_per_task", "deadline_scale"))
        check_positive(self, ("temperature",), allow_zero=True)
        if self.kind not in EVAL_KINDS:
            raise ConfigError(f"config.eval.kind={self.kind!r}; known: {EVAL_KINDS}")
        if not 0.0 < self.pass_score <= 1.0:
            raise ConfigError(f"config.eval.pass_score must be in (0, 1], got {self.pass_score!r}")

    def due(self, version: int, last: int) -> bool:
        """Whether ``version`` is evaluated: every k-th, and the last."""
        return bool(self.every) and (version % self.every == 0 or version >= last)


class Evaluator(Protocol):
    def start(self, resume_step: int | None) -> None: ...

    def evaluate(self, version: int, params) -> dict: ...

    def finish(self) -> list[dict]: ...

    def close(self) -> None: ...


class FirstCallEvaluator:
    """``HeldOutEval`` (the first call of each held-out task, in-process) in the loop's thread: its numbers go
    into the step's record; a failure is logged and counted (``eval/failed``), never fatal."""

    def __init__(self, held_out: Callable[[Any], dict]):
        self.held_out = held_out
        self.results: list[dict] = []

    def start(self, resume_step: int | None) -> None:
        pass

    def evaluate(self, version: int, params) -> dict:
        t0 = time.perf_counter()
        try:
            r = self.held_out(params)
        except Exception:  # noqa: BLE001 - the eval is a measurement; the run goes on without it
            log.exception("held-out eval at version %d failed", version)
            return {"eval/failed": 1}
        self.results.append({"version": version, **r})
        log.info("rl: eval at version %d: %s (%.1fs)", version, r, time.perf_counter() - t0)
        return {"eval/reward": r["eval_reward"], "eval/exact": r["eval_exact"], "eval/format": r["eval_format"],
                "eval/grader_errors": r["eval_grader_errors"], "eval/version": version,
                "eval/s": time.perf_counter() - t0,
                # multi-LoRA: each adapter on each adapter's task set (rl/lora_run.py: AdapterEvals)
                **{f"eval/{k[len('eval_'):]}": v for k, v in r.items() if k.startswith("eval_adapter")}}

    def finish(self) -> list[dict]:
        return sorted(self.results, key=lambda r: r["version"])

    def close(self) -> None:
        pass


def make_evaluator(cfg: Any, tok, cell, make_backend: Callable, workdir: str, frozen=None) -> Evaluator | None:
    """The run's evaluator (``cfg``: its RLConfig), or None (``eval.every=0``); whole episodes get an engine of
    their own on ``cell`` (``make_backend(cfg, cell, params, version, name, tok)``). ``frozen``: a LoRA run's
    base (the params evaluated are its adapters, merged in or served beside it)."""
    e = cfg.eval
    if not e.every:
        return None
    if e.kind == "first_call":
        try:
            return FirstCallEvaluator(_first_call(cfg, tok, frozen))
        except ValueError as err:
            raise ConfigError(f"config.eval: {err}") from None
    return _episodes(cfg, tok, cell, make_backend, workdir, frozen)


def _first_call(cfg: Any, tok, frozen) -> Callable[[Any], dict]:
    """The first-call eval of the held-out tasks; multi-LoRA: each adapter on each adapter's task set."""
    import functools

    from gyre_jax.rl import lora_run
    from gyre_jax.rl.evaluate import HeldOutEval

    e = cfg.eval

    def held_out(tasks, prepare=None):
        return HeldOutEval(cfg.model, tasks, tok, system_prompt=cfg.harness.system_prompt,
                           samples_per_task=e.samples_per_task, max_tokens=cfg.harness.max_tokens,
                           temperature=e.temperature, seed=cfg.seed, max_len=cfg.cells.max_len,
                           sandbox=cfg.harness.sandbox, prepare=prepare)

    if frozen is not None and cfg.train.lora.adapters > 1:
        return lora_run.AdapterEvals([held_out(src.eval_tasks(e.tasks)) for src in cfg.adapter_sources], frozen)
    tasks = cfg.task_source.eval_tasks(e.tasks)  # disjoint from the RL and SFT tasks
    return held_out(tasks, None if frozen is None else functools.partial(lora_run.merged, frozen))


def _episodes(cfg: Any, tok, cell, make_backend: Callable, workdir: str, frozen) -> Evaluator:
    """Whole episodes of the held-out tasks through the run's harness, on their own engine on ``cell``, on a
    thread of their own."""
    from gyre_jax.cells.frozen_base import Adapted
    from gyre_jax.rl.episode_eval import BackgroundEval, EpisodeEval

    e = cfg.eval
    # As many episodes in flight as the eval engine has decode slots: multi-call episodes spend most of
    # their time in tools and test suites, so a group's worth in flight leaves the engine idle.
    # A longer deadline than the rollouts': a loaded machine (this run's own training) must not score as the
    # policy's timeouts (on Dec 4 a third of the warm start's eval episodes timed out beside RL's start).
    h = cfg.harness
    hc = dataclasses.replace(h, base_url="http://127.0.0.1:1/v1", temperature=e.temperature,
                             deadline_s=h.deadline_s * e.deadline_scale, deadline_scale=h.deadline_scale * e.deadline_scale,
                             concurrency=max(cfg.scheduler.group_size, cfg.cells.max_slots))

    def backend(params, version):
        return make_backend(cfg, cell, params if frozen is None else Adapted(frozen, params), version, "eval", tok)

    ev = EpisodeEval(tasks=cfg.task_source.eval_tasks(e.tasks), samples_per_task=e.samples_per_task,
                     pass_score=e.pass_score, harness_config=hc, make_harness=h.make, make_backend=backend,
                     tokenizer=tok, workdir=os.path.join(workdir, "eval"), seed=cfg.seed, max_tokens_cap=h.max_tokens,
                     start_timeout_s=cfg.cells.start_timeout_s)
    return BackgroundEval(ev, log_dir=os.path.join(workdir, "eval"), on_close=(ev.close,))
