"""The RL loop (job 'rl'): engines on rollout cells behind the recording proxy, the
harness running groups of rollouts against it over HTTP, the scheduler's controller
switching cells by its policy, finished groups flowing store -> processor -> the
cells' elastic step, new weights published to the serving cells; N steps.

Data flow of one step (docs/design.md has the picture)::

    Launch (policy: admission bounds staleness)
      -> harness group (HTTP, 127.0.0.1) -> proxy -> router -> JetStream engine (rollout cell)
      -> proxy writes each call (tokens, behavior log-probs, version) to the TrajectoryStore
      -> harness grades the workspace (subprocess), appends the RolloutOutcome
    group finished -> ready (TrainerAdapter) -> TakeGroups (policy) -> step full:
      process_step (rewards -> group-normalized advantages, trees, packing)
      -> ElasticTrainer step (core + every cell in train role) -> store.mark_trained
      -> checkpoint (params, optimizer, RNG, store cursor, buffered rollouts)
    Publish (policy) -> engines of rollout cells get the new version

Everything lives under ``<workdir>/<mode>/``: store, workspaces, checkpoints,
metrics.jsonl, timeline.png, summary.json. Rerunning the same command resumes
from the last checkpoint (no finished rollout lost, none trained twice).
"""
from __future__ import annotations

import collections
import functools
import json
import logging
import os
import queue
import re
import threading
import time

import jax
import numpy as np

from gyre_jax.rl.config import RLConfig

log = logging.getLogger(__name__)
RUN_ID = "rl"


def ensure_cpu_devices(n: int) -> None:
    """Ask for ``n`` host devices before JAX starts its CPU backend (no effect on GPU/TPU).

    If a backend is already up (e.g. tests: conftest sets 8), the count must match."""
    try:
        jax.config.update("jax_num_cpu_devices", n)
    except Exception:  # noqa: BLE001 - backend already initialised
        pass
    if jax.default_backend() == "cpu" and len(jax.devices()) != n:
        raise ValueError(f"RL loop: config.num_cpu_devices={n} but JAX already runs with {len(jax.devices())} "
                         "CPU devices (the count is fixed once JAX starts)")


def run(config, workdir: str) -> dict:
    """Job 'rl' (gyre_jax.jobs): run the loop in ``<workdir>/<mode>``; returns the summary dict."""
    cfg = RLConfig.from_config(config)
    ensure_cpu_devices(cfg.num_cpu_devices)
    return RLLoop(cfg, os.path.join(workdir, cfg.scheduler.mode)).run()


def _quiet_third_party_logs() -> None:
    """Orbax and JetStream log every save/step at INFO through absl; keep the progress bar readable."""
    from absl import logging as absl_logging

    if absl_logging.get_verbosity() >= absl_logging.INFO:
        absl_logging.set_verbosity(absl_logging.WARNING)


def _scalars(rec: dict) -> dict:
    """A step record as the metrics writer takes it: scalars and strings only."""
    out = {}
    for k, v in rec.items():
        if k == "step":
            continue
        if isinstance(v, (list, tuple)):
            v = ",".join(str(x) for x in v)
        out[k] = v
    return out


class RLLoop:
    def __init__(self, cfg: RLConfig, workdir: str):
        self.cfg, self.workdir = cfg, os.path.abspath(workdir)
        self.history: list[dict] = []
        self.evals: list[dict] = []  # held-out evals of this run: {"version", "eval_reward", ...}

    # ------------------------------------------------------------------ setup
    def _task_fn(self, g: int):
        from gyre_jax.agents.tasks import make_task

        t = self.cfg.task
        return make_task(t.family, (self.cfg.seed * 1_000_003 + g) % (2**31), **t.kwargs())

    def _harness_config(self, base_url: str):
        from gyre_jax.agents.config import HarnessConfig

        h = self.cfg.harness
        return HarnessConfig(base_url=base_url, run_id=RUN_ID, max_tokens=h.max_tokens, temperature=h.temperature,
                             send_tools_schema=False, bytes_per_token=1.0, max_turns=h.max_turns,
                             context_budget_tokens=self.cfg.cells.max_len, deadline_s=h.deadline_s,
                             request_timeout_s=h.request_timeout_s, max_retries=h.max_retries,
                             backoff_base_s=h.backoff_base_s, concurrency=self.cfg.scheduler.group_size,
                             grader_timeout_s=h.grader_timeout_s, grader_concurrency=2,
                             system_prompt=h.system_prompt or None)

    def _fresh_params(self, tok):
        from gyre_jax.model import init_params
        from gyre_jax.rl.sft import demo_examples, noisy_tasks, warm_start

        cfg = self.cfg
        params = init_params(cfg.model, jax.random.key(cfg.seed))
        if cfg.sft.steps == 0:
            return params, []
        # Demonstration tasks come from seeds the RL run never draws (offset).
        from gyre_jax.agents.tasks import make_task

        tasks = [make_task(cfg.task.family, 2**30 + s, **cfg.task.kwargs()) for s in range(cfg.sft.demos)]
        if cfg.sft.noisy_fraction:  # deliberately wrong answers: headroom for RL (SFTConfig.noisy_fraction)
            tasks, _ = noisy_tasks(tasks, cfg.sft.noisy_fraction, cfg.seed, cfg.sft.noisy_kind)
        examples = demo_examples(tasks, self._harness_config("http://demo.invalid/v1"), tok)
        return warm_start(params, cfg.model, examples, steps=cfg.sft.steps, rows=cfg.sft.rows,
                          row_len=cfg.train.row_len, learning_rate=cfg.sft.learning_rate, seed=cfg.seed,
                          progress=cfg.progress)

    def _warm(self, steps, cs) -> None:
        """Compile grad_step on every cell's training mesh (and the core's update) ahead of use:
        a satellite joining a step would otherwise compile while holding a micro-batch."""
        from gyre_jax.trajectory.binpack import pack_trees
        from gyre_jax.trajectory.node import TreeNode

        t = self.cfg.train
        tree = TreeNode.span([1, 2, 3], children=[TreeNode.span([4, 5], trainable=True)])
        mb = pack_trees([tree], [0.0], t.row_len, min_rows=t.micro_batch_rows).rows.as_dict()
        t0 = time.perf_counter()
        try:
            for c in cs:
                steps.warm(c.train_mesh, mb, core=c.index == 0)
        except Exception:  # noqa: BLE001 - only a speed-up; the step compiles on first use anyway
            log.exception("warm-up compile failed")
        log.info("rl: compiled the training steps of %d cells in %.1fs", len(cs), time.perf_counter() - t0)

    def _warm_engines(self, server, backends, tok) -> None:
        """One short call per engine with a real task's prompt, so prefill and generate are
        compiled before any rollout's deadline starts running."""
        from gyre_jax.rl.evaluate import first_call_prompt
        from gyre_jax.serving.backend import GenerateRequest, SamplingParams

        prompt = np.asarray(first_call_prompt(self._task_fn(0), tok, self.cfg.harness.system_prompt or None), np.int32)

        async def one(backend, i):
            req = GenerateRequest(request_id=f"warm-{i}", prompt_ids=prompt, sampling=SamplingParams(max_tokens=2))
            async for _ in backend.submit(req):
                pass

        async def all_():
            import asyncio

            await asyncio.gather(*(one(b, i) for i, b in enumerate(backends.values())))

        t0 = time.perf_counter()
        server.run(all_(), timeout=600)
        log.info("rl: warmed %d engines in %.1fs", len(backends), time.perf_counter() - t0)

    def _make_eval(self, tok):
        """The held-out eval (config.eval), or None when eval.every == 0."""
        from gyre_jax.agents.tasks import make_task
        from gyre_jax.rl.evaluate import HeldOutEval

        cfg, e = self.cfg, self.cfg.eval
        if not e.every:
            return None
        # Seeds disjoint from the RL tasks' (seed * 1_000_003 + g) and the SFT demonstrations' (2**30 + s).
        tasks = [make_task(cfg.task.family, 2**29 + s, **cfg.task.kwargs()) for s in range(e.tasks)]
        return HeldOutEval(cfg.model, tasks, tok, system_prompt=cfg.harness.system_prompt or None,
                           samples_per_task=e.samples_per_task, max_tokens=cfg.harness.max_tokens,
                           temperature=e.temperature, seed=cfg.seed, max_len=cfg.cells.max_len)

    def _eval_due(self, version: int) -> bool:
        e = self.cfg.eval.every
        return bool(e) and (version % e == 0 or version >= self.cfg.steps)

    def _run_eval(self, evaluator, version: int, params) -> dict:
        """One held-out eval on the main thread (~2 s for the demo); appended to self.evals."""
        t0 = time.perf_counter()
        r = evaluator(params)
        self.evals.append({"version": version, **r})
        log.info("rl: eval at version %d: %s (%.1fs)", version, r, time.perf_counter() - t0)
        return {"eval/reward": r["eval_reward"], "eval/exact": r["eval_exact"], "eval/format": r["eval_format"],
                "eval/grader_errors": r["eval_grader_errors"], "eval/version": version,
                "eval/s": time.perf_counter() - t0}

    def _resumed_groups(self, store, rollout_ids, steps_done: int):
        from gyre_jax.rl.adapters import Group

        by_group: dict[str, list] = collections.OrderedDict()
        for rid in rollout_ids:
            o = store.outcome(rid)
            by_group.setdefault(o.group_id, []).append(o)
        out = []
        for gid, os_ in by_group.items():
            versions = [v for o in os_ for v in o.policy_versions]
            out.append(Group(gid, min(versions) if versions else steps_done, [o.rollout_id for o in os_],
                             self.cfg.train.work_s_per_row * len(os_)))
        return out

    # ------------------------------------------------------------------ run
    def run(self) -> dict:
        from tqdm.auto import tqdm

        from gyre_jax import cells as cells_lib
        from gyre_jax.cells.loss import policy_loss_fn
        from gyre_jax.losses import METRIC_REDUCTIONS, PolicyLossConfig
        from gyre_jax.model import init_boxed, param_logical_axes
        from gyre_jax.rl.adapters import (CellPoolAdapter, Launcher, LoopThread, ProxyAdapter, RealClock, Timeline,
                                          TrainerAdapter)
        from gyre_jax.rl.checkpoint import CheckpointConfig, Checkpointer, abstract_like, resume_store
        from gyre_jax.rl.metrics import MetricsWriter
        from gyre_jax.scheduler import policy as policy_lib
        from gyre_jax.scheduler.controller import Controller
        from gyre_jax.serving.engine import GyreEngine
        from gyre_jax.serving.jetstream_backend import JetStreamBackend
        from gyre_jax.serving.proxy import Proxy, ProxyConfig
        from gyre_jax.serving.router import Router
        from gyre_jax.serving.server_thread import ServerThread
        from gyre_jax.serving.tokenizer import ByteTokenizer
        from gyre_jax.trajectory.processor import ProcessorConfig
        from gyre_jax.trajectory.rewards import AdvantageConfig
        from gyre_jax.trajectory.store import StoreConfig, TrajectoryStore

        cfg, wd = self.cfg, self.workdir
        t_start = time.perf_counter()
        _quiet_third_party_logs()
        os.makedirs(wd, exist_ok=True)
        tok = ByteTokenizer()
        mc = cfg.model
        if tok.vocab_size > mc.vocab_size:
            raise ValueError(f"model.vocab_size={mc.vocab_size} < byte tokenizer's {tok.vocab_size} ids")
        evaluator = self._make_eval(tok)  # held-out eval (config.eval) or None; a bad size fails here, early

        # Cells, state, steps.
        cs = cells_lib.split_cells(cells_lib.CellConfig(cell_size=cfg.cells.cell_size,
                                                        train_tensor=cfg.cells.train_tensor,
                                                        serve_tensor=cfg.cells.serve_tensor))
        n_cells, core = len(cs), cs[0]
        t = cfg.train
        opt = cells_lib.OptimizerConfig(learning_rate=t.learning_rate, warmup_steps=t.warmup_steps,
                                        weight_decay=t.weight_decay, max_grad_norm=t.max_grad_norm,
                                        b2=t.adam_b2, eps=t.adam_eps)
        spec = cells_lib.StateSpec.create(functools.partial(init_boxed, mc),
                                          cells_lib.make_optimizer(opt, param_logical_axes(mc)))
        loss_cfg = PolicyLossConfig(eps_low=t.eps_low, eps_high=t.eps_high, entropy_coef=t.entropy_coef)
        steps = cells_lib.CellSteps(spec, policy_loss_fn(mc, loss_cfg), cells_lib.make_schedule(opt),
                                    reductions=METRIC_REDUCTIONS)
        warm = threading.Thread(target=self._warm, args=(steps, cs), name="gyre-warm")  # joined at exit
        warm.start()  # compile every cell's training step while SFT and set-up run
        store = TrajectoryStore(os.path.join(wd, "store"), run_id=RUN_ID, config=StoreConfig(vocab_size=mc.vocab_size))
        every = cfg.checkpoint_every or cfg.steps
        ckpt = Checkpointer(CheckpointConfig(directory=os.path.join(wd, "checkpoints"), max_to_keep=2,
                                             save_interval_steps=every))
        restored = ckpt.restore_latest(abstract_like(spec.abstract_state(), spec.state_shardings(core.train_mesh)))
        sft_history: list[dict] = []
        if restored is not None:
            state, rng, steps_done = restored.train_state, restored.rng, restored.step
            pending = resume_store(store, restored)
            ready = self._resumed_groups(store, pending, steps_done)
            print(f"rl: resumed from checkpoint step {steps_done} ({len(pending)} finished rollouts to train in "
                  f"{len(ready)} groups)", flush=True)
        else:
            params, sft_history = self._fresh_params(tok)
            state = spec.state_from_params(params, core.train_mesh)
            rng, steps_done, ready = jax.random.key(cfg.seed), 0, []
        if steps_done >= cfg.steps:
            print(f"rl: already at step {steps_done} >= steps={cfg.steps}; nothing to do", flush=True)
        trainer = cells_lib.ElasticTrainer(steps, core, state)
        if trainer.version != steps_done:
            raise ValueError(f"checkpoint step {steps_done} != policy version {trainer.version}")
        t_setup = time.perf_counter()

        # Policy, roles, engines, proxy.
        s = cfg.scheduler
        pc = policy_lib.PolicyConfig(
            mode=s.mode, total_steps=cfg.steps, groups_per_step=s.groups_per_step, group_size=s.group_size,
            staleness_bound=s.staleness_bound,
            async_train_cells=s.async_train_cells if s.mode.startswith("async") else 0,
            serve_reserve=s.serve_reserve, min_work_per_switch_s=s.min_work_per_switch_s)
        roles = policy_lib.initial_roles(pc, n_cells)
        if s.mode == "colocate":
            serving = list(range(n_cells))
        elif s.mode.startswith("async"):
            serving = list(range(s.async_train_cells, n_cells))
        else:
            serving = list(range(1, n_cells))
        faults = None
        if cfg.faults.any:
            from gyre_jax.testing.fake_rl_faults import RLFaults  # test hook (config.faults)

            faults = RLFaults(cfg.faults)
        on_step_started = None
        if cfg.faults.pause_at_step:
            from gyre_jax.testing.fake_rl_faults import pause_at_step  # test hook: kill -9 mid-step

            on_step_started = functools.partial(pause_at_step, cfg.faults.pause_at_step)
        params0 = trainer.state.params
        names = {c: f"cell{c}" for c in serving}
        special = (tok.special["<|bos|>"], tok.special["<|eos|>"], tok.special["<|pad|>"])

        async def build():
            backends = []
            for c in serving:
                b = JetStreamBackend(GyreEngine(mc, params0, mesh=cs[c].serve_mesh, max_slots=cfg.cells.max_slots,
                                                max_len=cfg.cells.max_len, version=steps_done, name=names[c],
                                                special_ids=special, tokens_per_call=cfg.cells.tokens_per_call),
                                     name=names[c])
                backends.append(faults.wrap(b) if faults is not None else b)
            return Proxy(Router(backends, wait_for_cell_s=600.0), tok, store,
                         ProxyConfig(max_tokens_cap=cfg.harness.max_tokens))

        server = ServerThread(build)
        url = server.start()
        backends = {c: server.proxy.router.cells[names[c]] for c in serving}
        self._warm_engines(server, backends, tok)
        hloop = LoopThread()
        clock = RealClock()
        timeline = Timeline(clock, roles)
        wake = threading.Event()
        steps_q: queue.Queue = queue.Queue()
        proxy_ad = ProxyAdapter(server, names, [c for c in serving if roles[c] == "rollout"])
        pool = CellPoolAdapter(cells=cs, roles=roles, backends=backends, proxy=proxy_ad, timeline=timeline,
                               notify=wake.set, version=steps_done, slots=cfg.cells.max_slots)
        proc = ProcessorConfig(row_len=t.row_len, advantage=AdvantageConfig(
            mode=t.advantage, negative_scale=t.negative_advantage_scale))

        def on_step(info: dict) -> None:  # trainer thread: latest_params() is exactly this step's version here
            if evaluator is not None and self._eval_due(info["version"]):
                info["eval_params"] = trainer_ad.latest_params()
            steps_q.put(info)

        def after_update(version: int) -> None:
            if ckpt.should_save(version) or version >= cfg.steps:
                ckpt.save(version, train_state=trainer.state, rng=rng, store_cursor=store.cursor_state(),
                          buffer=trainer_ad.buffered_rollouts(), meta={"mode": s.mode}, force=version >= cfg.steps)

        trainer_ad = TrainerAdapter(trainer=trainer, store=store, processor_config=proc, groups_per_step=s.groups_per_step,
                                    micro_batch_rows=t.micro_batch_rows, cells=cs, cell_roles=pool.roles,
                                    notify=wake.set, on_step=on_step, work_s_per_row=t.work_s_per_row,
                                    row_len=t.row_len, steps_done=steps_done, ready=ready, after_update=after_update,
                                    on_step_started=on_step_started)
        pool.trainer = trainer_ad
        existing = [int(m.group(1)) for r in store.rollout_ids() if (m := re.match(r"g(\d+)-", r))]
        launcher = Launcher(loop=hloop, harness_config=self._harness_config(url + "/v1"), store=store, run_id=RUN_ID,
                            task_fn=self._task_fn, group_size=s.group_size,
                            workspace_root=os.path.join(wd, "workspaces"),
                            on_group=lambda g: (trainer_ad.add_group(g) if g is not None else wake.set()),
                            work_s=lambda tokens: trainer_ad.work_s_per_row * max(1.0, tokens / t.row_len),
                            next_group=max(existing, default=-1) + 1, faults=faults)
        launcher.set_launched(steps_done * s.groups_per_step + len(ready))
        controller = Controller(pc, cells=pool, proxy=proxy_ad, rollouts=launcher, trainer=trainer_ad, clock=clock)
        metrics = MetricsWriter(wd, purge_step=steps_done)  # TensorBoard events + metrics.jsonl
        print(f"rl: mode={s.mode} cells={n_cells}x{cfg.cells.cell_size} devices, roles={''.join(r[0] for r in roles)}, "
              f"{cfg.steps} steps x {s.groups_per_step} groups x {s.group_size} rollouts, proxy {url}, "
              f"setup {t_setup - t_start:.1f}s (SFT {len(sft_history)} steps), workdir {wd}", flush=True)

        # The starting policy's eval (version steps_done) goes into the first step record of
        # this run as eval/*_start, so metrics.jsonl stays one line per step.
        start_eval = self._run_eval(evaluator, *trainer_ad.latest_params()) if evaluator is not None else {}
        start_eval = {k + "_start": v for k, v in start_eval.items()}
        last = dict(t=clock.now(), gen=0, switches=0)
        step_end_s: list[float] = []

        def take_record() -> dict:
            info = steps_q.get()
            rec = self._step_record(info, clock, last, server, timeline, launcher, pool)
            if start_eval:
                rec.update(start_eval)
                start_eval.clear()
            if "eval_params" in info:
                rec.update(self._run_eval(evaluator, *info.pop("eval_params")))
            step_end_s.append(rec["time_s"])
            metrics.write(rec["step"], _scalars(rec))
            self.history.append(rec)
            return rec

        bar = tqdm(total=cfg.steps, initial=steps_done, desc=f"rl[{s.mode}]", unit="step", disable=not cfg.progress)
        try:
            while not controller.done():
                controller.tick()
                while not steps_q.empty():
                    take_record()
                    bar.update(1)
                roles_s = "".join(">" if r.startswith("to") else r[0] for r in pool.roles())
                reward_s = f"reward={self.history[-1]['reward']:.3f} " if self.history else ""
                bar.set_postfix_str(f"{reward_s}in_flight={launcher.running_rollouts()} roles={roles_s}", refresh=False)
                for errs in (pool.errors, launcher.errors, trainer_ad.errors):
                    if errs:
                        raise RuntimeError(f"RL loop: a component failed: {errs[0]!r}") from errs[0]
                wake.wait(s.poll_s)
                wake.clear()
            while not steps_q.empty():  # the last step's record
                take_record()
        finally:
            bar.close()
            wall_rl = clock.now()
            segments = timeline.close()
            trainer_ad.stop()
            launcher.close()
            pool.close()
            server.stop()
            hloop.stop()
            ckpt.close()
            metrics.close()
            store.close()
        return self._finish(segments, n_cells, step_end_s, wall_rl, time.perf_counter() - t_start, controller,
                            launcher, timeline, faults, server, sft_history)

    # ------------------------------------------------------------------ per step
    def _step_record(self, info, clock, last, server, timeline, launcher, pool) -> dict:
        now = clock.now()
        rep, st = info["report"], info["stats"]
        scores = np.asarray(info["scores"], np.float64)
        gen = int(server.proxy.counters.get("completion_tokens", 0))
        sw = timeline.switches[last["switches"]:]
        dt = max(now - last["t"], 1e-9)
        rec = {
            "step": info["step"], "version": info["version"], "time_s": now,
            "reward": float(scores.mean()) if scores.size else float("nan"),
            "exact": float((scores == 1.0).mean()) if scores.size else float("nan"),
            "partial_credit": float(((scores > 0) & (scores < 1)).mean()) if scores.size else float("nan"),
            "rollouts": info["rollouts"], "trained_rollouts": st.trained_rollouts,
            **{f"failures/{k}": v for k, v in st.failures.items()},
            "staleness_mean": rep.staleness_mean, "staleness_max": rep.staleness_max,
            "group_versions": info["group_versions"],
            "dedup_factor": st.dedup_factor, "rows": info["rows"], "micro_batches": info["micro_batches"],
            "loss": rep.loss, "grad_norm": rep.grad_norm, "learning_rate": rep.learning_rate,
            **{f"loss/{k}": v for k, v in rep.stats.items() if k != "loss"},
            "gen_tokens_per_s": (gen - last["gen"]) / dt,
            "train_tokens_per_s": st.packed_tokens / max(rep.seconds, 1e-9),
            "train_step_s": rep.seconds,
            "train_busy_cell_s": float(sum(done - pulled for _, pulled, done in rep.timeline)),
            "process_s": info["process_s"], "cells_trained": info["cells_used"],
            "switches": len(sw), "switch_s_mean": float(np.mean([x[3] for x in sw])) if sw else 0.0,
            "switch_s_max": float(np.max([x[3] for x in sw])) if sw else 0.0,
            "rollouts_in_flight": launcher.running_rollouts(), "roles": pool.roles(),
            "engine_errors": int(server.proxy.counters.get("engine_errors", 0)),
            "retries": int(sum(r["retries"] for r in launcher.results)),
        }
        last.update(t=now, gen=gen, switches=len(timeline.switches))
        return rec

    # ------------------------------------------------------------------ end
    def _finish(self, segments, n_cells, step_end_s, wall_rl, wall, controller, launcher, timeline, faults, server,
                sft_history) -> dict:
        from gyre_jax.rl import summary as summary_lib

        cfg, h = self.cfg, self.history
        k = min(cfg.first_last, max(1, len(h) // 2))
        first = float(np.nanmean([r["reward"] for r in h[:k]])) if h else float("nan")
        lastr = float(np.nanmean([r["reward"] for r in h[-k:]])) if h else float("nan")
        util = summary_lib.utilization(segments, n_cells, wall_rl)
        summary_lib.plot_timeline(segments, n_cells, step_end_s, os.path.join(self.workdir, "timeline.png"),
                                  title=f"gyre_jax RL loop, mode={cfg.scheduler.mode}: cell roles over time")
        out = {
            "mode": cfg.scheduler.mode, "steps": len(h), "wall_s": wall, "rl_s": wall_rl,
            "reward_first": first, "reward_last": lastr, "first_last_steps": k,
            "util_rollout": util["rollout"], "util_train": util["train"], "util_switching": util["switching"],
            # cell-time actually computing micro-batches (the rest of train role is waiting)
            "util_train_busy": sum(r["train_busy_cell_s"] for r in h) / max(n_cells * wall_rl, 1e-9),
            "staleness_mean": float(np.mean([r["staleness_mean"] for r in h])) if h else 0.0,
            "staleness_max": float(max([r["staleness_max"] for r in h], default=0.0)),
            "switches": len(timeline.switches), "statuses": dict(launcher.statuses),
            "engine_errors": int(server.proxy.counters.get("engine_errors", 0)),
            "retries": int(sum(r["retries"] for r in launcher.results)),
            "injected_faults": dict(faults.injected) if faults is not None else {},
            "sft_steps": len(sft_history), "sft_loss_last": sft_history[-1]["loss"] if sft_history else None,
        }
        if self.evals:  # held-out eval (config.eval): the starting policy's and the last one's
            out.update(eval_first=self.evals[0]["eval_reward"], eval_last=self.evals[-1]["eval_reward"],
                       eval_first_version=self.evals[0]["version"], eval_last_version=self.evals[-1]["version"],
                       eval_exact_first=self.evals[0]["eval_exact"], eval_exact_last=self.evals[-1]["eval_exact"])
        with open(os.path.join(self.workdir, "summary.json"), "w") as f:
            json.dump(out, f, indent=1)
        if h:
            print(f"rl[{out['mode']}]: reward {first:.3f} -> {lastr:.3f} (mean of first/last {k} steps), "
                  f"{len(h)} steps in {wall_rl:.1f}s of RL ({wall:.1f}s total); statuses {out['statuses']}"
                  + (f"; held-out eval {out['eval_first']:.3f} -> {out['eval_last']:.3f} (versions "
                     f"{out['eval_first_version']} -> {out['eval_last_version']})" if self.evals else ""), flush=True)
        print(summary_lib.table(summary_lib.mode_summaries(os.path.dirname(self.workdir))), flush=True)
        return out
