"""``build(config) -> Components``: every part of the RL loop, made once and started.

The cells and their layout (the trainer and the engines are placed from its role ->
mesh map), the train state (the last checkpoint with its data position and buffered
rollouts, or a fresh model warm-started by SFT), the engines on the serving cells
behind the router and the recording proxy, the harness launcher (finishing groups a
stop cut short), the grain pipeline that feeds the trainer, and the scheduler's
controller over adapters of all of them. ``gyre_jax.rl.loop.drive`` runs them.
"""
from __future__ import annotations

import dataclasses
import functools
import logging
import os
import re
import secrets
import tempfile
import threading
import time
from typing import Any, Callable

import jax
import numpy as np
from absl import logging as absl_logging

from gyre_jax import cells as cells_lib
from gyre_jax.cells.loss import policy_loss_fn
from gyre_jax.cells.mesh import CellLayout, Role
from gyre_jax.distributed import ensure_cpu_devices
from gyre_jax.errors import ConfigError, RunFailed
from gyre_jax.losses import METRIC_REDUCTIONS
from gyre_jax.model import init_boxed, init_params, param_logical_axes
from gyre_jax.rl import faults as faults_lib
from gyre_jax.rl import reference as reference_lib
from gyre_jax.rl.cell_pool import CellPoolAdapter, ProxyAdapter
from gyre_jax.rl.checkpoint import CheckpointConfig, Checkpointer, abstract_like, resume_store
from gyre_jax import planner
from gyre_jax.rl.config import RLConfig
from gyre_jax.agents.sandbox import SandboxConfig
from gyre_jax.rl.episode_eval import BackgroundEval, EpisodeEval
from gyre_jax.rl.evaluate import HeldOutEval, first_call_prompt
from gyre_jax.rl.launcher import Launcher, ResumedGroup, group_number, resume_plan
from gyre_jax.rl.metrics import MetricsWriter, WandbOptions
from gyre_jax.rl.runtime import LoopThread, RealClock, Timeline
from gyre_jax.rl import warm_cache
from gyre_jax.rl.sft import demo_trees, noisy_tasks, warm_start
from gyre_jax.rl.trainer import TrainerAdapter
from gyre_jax.scheduler import policy as policy_lib
from gyre_jax.scheduler.controller import Controller
from gyre_jax.scheduler.modes import get_mode
from gyre_jax.scheduler.vocab import ROLLOUT
from gyre_jax.serving.backend import GenerateRequest, SamplingParams
from gyre_jax.serving.proxy import Proxy, ProxyConfig
from gyre_jax.serving.router import Router
from gyre_jax.serving.server_thread import ServerThread
from gyre_jax.serving.tokenizer import ByteTokenizer, load_tokenizer
from gyre_jax.trajectory.dataset import RowStream, StreamingDataset
from gyre_jax.trajectory.store import StoreBusy, StoreConfig, TrajectoryStore

log = logging.getLogger(__name__)
RUN_ID = "rl"

# make_backend(cfg, cell, params, version, name, tokenizer) -> a serving Backend whose
# ``engine`` has ``publish(params, version)`` (the loop's one way to load weights).
BackendFactory = Callable[[RLConfig, Any, Any, int, str, Any], Any]


def jetstream_backend(cfg: RLConfig, cell, params, version: int, name: str, tok):
    """A JetStream engine of our model on the cell's serving mesh (the default)."""
    # JetStream imports tensorflow (seconds): only once engines are built, so a bad config
    # fails before that cost.
    from gyre_jax.serving.engine import GyreEngine
    from gyre_jax.serving.jetstream_backend import JetStreamBackend

    special = (tok.special["<|bos|>"], tok.special["<|eos|>"], tok.special["<|pad|>"])
    c = cfg.cells
    engine = GyreEngine(cfg.model, params, mesh=cell.mesh(Role.ROLLOUT), max_slots=c.max_slots, max_len=c.max_len,
                        version=version, name=name, special_ids=special, tokens_per_call=c.tokens_per_call)
    return JetStreamBackend(engine, name=name)


@dataclasses.dataclass
class Start:
    """Where this run starts: a checkpoint's step, or a fresh (warm-started) model."""

    steps_done: int
    sft_history: list[dict]  # the warm start's per-step metrics (empty on resume)
    setup_s: float


@dataclasses.dataclass
class Components:
    cfg: RLConfig
    workdir: str
    layout: CellLayout
    trainer: TrainerAdapter
    pool: CellPoolAdapter
    proxy: ProxyAdapter
    launcher: Launcher
    controller: Controller
    server: ServerThread
    harness_loop: LoopThread
    store: TrajectoryStore
    ckpt: Checkpointer
    metrics: MetricsWriter
    evaluator: HeldOutEval | BackgroundEval | None
    timeline: Timeline
    clock: RealClock
    wake: threading.Event
    start: Start
    faults: faults_lib.RLFaults | None
    chaos: faults_lib.Chaos | None
    records: list[dict] = dataclasses.field(default_factory=list)  # per-step infos from the trainer thread
    evals: list[dict] = dataclasses.field(default_factory=list)
    warm_thread: threading.Thread | None = None
    satellites: Any = None  # gyre_jax.pods.rl_job.Satellites when the cells run in separate processes

    def close(self) -> None:
        """Stop every thread and server; each part closes even if another fails to."""
        sats = () if self.satellites is None else (self.satellites.stop,)  # after the trainer and proxy stopped
        evals = (self.evaluator.close,) if isinstance(self.evaluator, BackgroundEval) else ()
        for stop in (self.trainer.stop, self.launcher.close, self.pool.close, self.server.stop, self.harness_loop.stop,
                     *sats, *evals, self.ckpt.close, self.metrics.close, self.store.close):
            try:
                stop()
            except Exception:  # noqa: BLE001 - close the rest
                log.exception("closing %s failed", getattr(stop, "__qualname__", stop))
        if self.warm_thread is not None:
            self.warm_thread.join(60)


# ---------------------------------------------------------------------------- build
def fresh_params(cfg: RLConfig, tok, mesh=None):
    """A new model's params (config.model.hf_path's weights, born on ``mesh``, or a random init), warm-started
    by SFT on scripted demonstrations (config.sft); (params, history)."""
    params = _hf_params(cfg, mesh) if cfg.hf_path else init_params(cfg.model, jax.random.key(cfg.warm_seed))
    if cfg.sft.steps == 0:
        return params, []
    key = warm_cache.cache_key(cfg) if cfg.sft.cache_dir else ""
    cached = warm_cache.load(cfg.sft.cache_dir, key, params) if key else None
    if cached is not None:
        return cached
    params, history = _warm_start(cfg, tok, params)
    if key:
        warm_cache.save(cfg.sft.cache_dir, key, params, history)
    return params, history


def _warm_start(cfg: RLConfig, tok, params):
    # Demonstration tasks: a stream the RL run never draws (gyre_jax.agents.task_sources).
    tasks = cfg.task_source.demo_tasks(cfg.sft.demos)
    if cfg.sft.noisy_fraction:  # deliberately wrong answers: headroom for RL (SFTConfig.noisy_fraction)
        tasks, _ = noisy_tasks(tasks, cfg.sft.noisy_fraction, cfg.warm_seed, cfg.sft.noisy_kind)
    examples = demo_trees(tasks, cfg.harness_config("http://demo.invalid/v1"), tok)
    return warm_start(params, cfg.model, examples, steps=cfg.sft.steps, rows=cfg.sft.rows, row_len=cfg.train.row_len,
                      learning_rate=cfg.sft.learning_rate, seed=cfg.warm_seed, progress=cfg.progress)


def _hf_params(cfg: RLConfig, mesh):
    from gyre_jax.model.hf import load_pretrained

    mc = cfg.model
    loaded, params = load_pretrained(cfg.hf_path, mesh=mesh, dtype=mc.param_dtype,
                                     vocab_pad_multiple=mc.vocab_pad_multiple, max_seq_len=mc.max_seq_len)
    if loaded.replace(remat=mc.remat, dtype=mc.dtype) != mc:
        raise RunFailed(f"{cfg.hf_path} changed since the config was read: {loaded} != {mc}")
    return params


def export_hf(cfg: RLConfig, params, workdir: str, version: int) -> str:
    """The policy as a HF checkpoint in <workdir>/hf_export (servable by vLLM/SGLang); its path."""
    from gyre_jax.model.hf import read_config, save_pretrained, source_dtype

    out = os.path.join(workdir, "hf_export")
    t0 = time.perf_counter()
    # In the source's dtype (bf16 for released checkpoints: what servers expect), else the params'.
    dtype = source_dtype(read_config(cfg.hf_path)) if cfg.hf_path else None
    save_pretrained(params, cfg.model, out, like=cfg.hf_path or None, dtype=dtype)
    with open(os.path.join(out, "gyre_version.txt"), "w") as f:
        f.write(f"{version}\n")
    print(f"rl: exported policy version {version} as a Hugging Face checkpoint to {out} "
          f"({time.perf_counter() - t0:.1f}s)", flush=True)
    return out


def _make_eval(cfg: RLConfig, tok) -> HeldOutEval | None:
    """The first-call held-out eval (config.eval.kind=first_call), or None (off, or whole episodes:
    ``_episode_eval`` builds that one once the cells exist)."""
    e = cfg.eval
    if not e.every or e.kind != "first_call":
        return None
    tasks = cfg.task_source.eval_tasks(e.tasks)  # disjoint from the RL and SFT tasks
    try:
        return HeldOutEval(cfg.model, tasks, tok, system_prompt=cfg.harness.system_prompt or None,
                           samples_per_task=e.samples_per_task, max_tokens=cfg.harness.max_tokens,
                           temperature=e.temperature, seed=cfg.seed, max_len=cfg.cells.max_len,
                           sandbox=SandboxConfig(kind=cfg.harness.sandbox))
    except ValueError as err:
        raise ConfigError(f"config.eval: {err}") from None


def _episode_eval(cfg: RLConfig, tok, cell, make_backend: BackendFactory, workdir: str) -> BackgroundEval:
    """Whole-episode held-out eval (config.eval.kind=episodes) on its own engine on ``cell``, on a thread."""
    e = cfg.eval
    # As many episodes in flight as the eval engine has decode slots: multi-call episodes spend most of
    # their time in tools and test suites, so a group's worth in flight leaves the engine idle.
    hc = dataclasses.replace(cfg.harness_config("http://127.0.0.1:1/v1"), temperature=e.temperature,
                             concurrency=max(cfg.scheduler.group_size, cfg.cells.max_slots))
    ev = EpisodeEval(tasks=cfg.task_source.eval_tasks(e.tasks), samples_per_task=e.samples_per_task,
                     pass_score=e.pass_score, harness_config=hc, make_harness=cfg.harness.make,
                     make_backend=lambda params, version: make_backend(cfg, cell, params, version, "eval", tok),
                     tokenizer=tok, workdir=os.path.join(workdir, "eval"), seed=cfg.seed,
                     max_tokens_cap=cfg.harness.max_tokens)
    return BackgroundEval(ev, log_dir=os.path.join(workdir, "eval"), on_close=(ev.close,))


def _warm_steps(steps, cs, cfg: RLConfig) -> None:
    """Compile grad_step on every cell's training mesh (and the core's update) ahead of use:
    a satellite joining a step would otherwise compile while holding a micro-batch."""
    from gyre_jax.trajectory.binpack import pack_trees
    from gyre_jax.trajectory.node import TreeNode

    t = cfg.train
    tree = TreeNode.span([1, 2, 3], children=[TreeNode.span([4, 5], trainable=True)])
    mb = pack_trees([tree], [0.0], t.row_len, min_rows=t.micro_batch_rows).rows.as_dict()
    t0 = time.perf_counter()
    try:
        for c in cs:
            steps.warm(c.mesh(Role.TRAIN), mb, core=c.index == 0)
    except Exception:  # noqa: BLE001 - only a speed-up; the step compiles on first use anyway
        log.exception("warm-up compile failed")
    log.info("rl: compiled the training steps of %d cells in %.1fs", len(cs), time.perf_counter() - t0)


def _warm_engines(cfg: RLConfig, server: ServerThread, backends: dict, tok) -> None:
    """One short call per engine with a real task's prompt, so prefill and generate are
    compiled before any rollout's deadline starts running."""
    import asyncio

    prompt = np.asarray(first_call_prompt(cfg.group_task(0), tok, cfg.harness.system_prompt or None), np.int32)

    async def one(backend, i):
        req = GenerateRequest(request_id=f"warm-{i}", prompt_ids=prompt, sampling=SamplingParams(max_tokens=2))
        async for _ in backend.submit(req):
            pass

    async def all_():
        await asyncio.gather(*(one(b, i) for i, b in enumerate(backends.values())))

    t0 = time.perf_counter()
    server.run(all_(), timeout=600)
    log.info("rl: warmed %d engines in %.1fs", len(backends), time.perf_counter() - t0)


def _serving_cells(mode: str, n_cells: int, async_train_cells: int) -> list[int]:
    """Cells that may ever serve in this mode (each gets an engine): the mode's to say."""
    return list(get_mode(mode).serving_cells(n_cells, async_train_cells))


def build(cfg: RLConfig, workdir: str, *, make_backend: BackendFactory = jetstream_backend) -> Components:
    """Every part of the loop, started; ``drive`` runs it. ``make_backend`` puts an engine on a cell."""
    t_start = time.perf_counter()
    _quiet_absl()
    workdir = os.path.abspath(workdir)
    os.makedirs(workdir, exist_ok=True)
    multi = jax.process_count() > 1  # pods: this is process 0, the core; cell k runs in process k
    if not multi:
        ensure_cpu_devices(cfg.num_cpu_devices)
    n_cells = cfg.check_devices(len(jax.devices()))
    planner.check_local(cfg, jax.devices())  # a layout that cannot fit its devices stops here, in one line
    # The store first: its writer lock says whether another run owns this workdir, before any work starts.
    try:
        store = TrajectoryStore(os.path.join(workdir, "store"), run_id=RUN_ID,
                                config=StoreConfig(vocab_size=cfg.model.vocab_size))
    except StoreBusy as e:
        raise ConfigError(f"--workdir={os.path.dirname(workdir)}: another run is using it ({e}); stop that run "
                          "or choose another --workdir") from None
    tok = _tokenizer(cfg)
    mc = cfg.model
    if tok.vocab_size > mc.vocab_size:
        raise ConfigError(f"config.model.vocab_size={mc.vocab_size} < the tokenizer's {tok.vocab_size} ids")
    evaluator = _make_eval(cfg, tok)

    # Cells and placement: the layout's role -> mesh map places the trainer and engines.
    pc = cfg.policy_config(n_cells)
    roles = policy_lib.initial_roles(pc, n_cells)
    cs = cells_lib.split_cells(cfg.cell_config())
    if multi:
        from gyre_jax.pods.rl_job import check_layout

        check_layout(cfg, cs)
    layout = CellLayout(cs, (Role.CORE,) + tuple(Role.ROLLOUT if r == ROLLOUT else Role.TRAIN for r in roles[1:]))
    core_mesh = layout.role_to_mesh()[Role.CORE][0]
    if cfg.eval.every and cfg.eval.kind == "episodes":  # its own engine, on the core cell's devices
        evaluator = _episode_eval(cfg, tok, layout.cells[0], make_backend, workdir)
    steps = _cell_steps(cfg)
    spec = steps.spec
    # Each satellite process compiles its own cell's step.
    warm = threading.Thread(target=_warm_steps, args=(steps, cs[:1] if multi else cs, cfg), name="gyre-warm",
                            daemon=True)  # a run that fails during set-up must not wait for its compiles
    warm.start()  # compile every cell's training step while SFT and set-up run

    # State: the last checkpoint (with the data position and the buffer), or a fresh model.
    ckpt = Checkpointer(CheckpointConfig(directory=os.path.join(workdir, "checkpoints"), max_to_keep=2,
                                         save_interval_steps=cfg.checkpoint_every or cfg.steps,
                                         this_process_only=multi))  # pods: the core alone owns and saves the state
    s = cfg.scheduler
    stream = RowStream(cfg.train.row_len)
    iterator = iter(StreamingDataset(stream, batch_size=cfg.train.micro_batch_rows, seed=cfg.seed))
    restored = ckpt.restore_latest(abstract_like(spec.abstract_state(), spec.state_shardings(core_mesh)),
                                   data_iterator=iterator, validate=lambda r: check_checkpoint(r, iterator))
    sft_history: list[dict] = []
    short: list[ResumedGroup] = []
    if restored is not None:
        state, steps_done = restored.train_state, restored.step
        pending = resume_store(store, restored)
        ready, short = resume_plan(store, RUN_ID, s.group_size, steps_done, pending)
        damaged = store.damaged_rollouts()
        if damaged:  # their rollouts are unfinished: resume_plan gives them an outcome and runs their slots again
            log.warning("rl: the store lost records of %d rollouts to damage: %s", len(damaged),
                        {r: d.reason for r, d in list(damaged.items())[:10]})
        ref_params = reference_lib.restore_reference(cfg, workdir, steps, core_mesh)
        print(f"rl: resumed from checkpoint step {steps_done} ({sum(len(g.rollout_ids) for g in ready)} finished "
              f"rollouts to train in {len(ready)} groups; {len(short)} groups cut short by the stop get their "
              f"{sum(len(g.rerun) for g in short)} missing rollouts run again)", flush=True)
    else:
        params, sft_history = fresh_params(cfg, tok, core_mesh)
        ref_params = reference_lib.keep_reference(cfg, workdir, params, steps, core_mesh)  # KL's target
        state = spec.state_from_params(params, core_mesh)
        steps_done, ready = 0, []
    if iterator.get_state()["step"] != steps_done:
        raise RunFailed(f"checkpoint step {steps_done} but its data position is {iterator.get_state()}")
    trainer = cells_lib.ElasticTrainer(steps, layout.core, state)
    if trainer.version != steps_done:
        raise RunFailed(f"checkpoint step {steps_done} != policy version {trainer.version}")
    if isinstance(evaluator, BackgroundEval):  # eval.jsonl keeps the lineage's versions; none is evaluated twice
        evaluator.start(resume_step=steps_done if restored is not None else None)
    if steps_done >= cfg.steps:
        print(f"rl: already at step {steps_done} >= steps={cfg.steps}; nothing to do", flush=True)

    # Engines on the cells that may serve, behind the router and the recording proxy.
    faults = faults_lib.RLFaults(cfg.faults) if cfg.faults.any else None
    chaos = faults_lib.Chaos(cfg.faults) if cfg.faults.chaos else None
    serving = _serving_cells(s.mode, n_cells, s.async_train_cells)
    names = {c: f"cell{c}" for c in serving}
    params0 = trainer.state.params
    sats, remote_backends = None, {}
    if multi:  # the satellite processes' cells: training handles, and engines built on the starting policy
        from gyre_jax.pods.rl_job import Satellites

        sats = Satellites(steps, core_mesh)
        remote_backends = sats.start_engines(params0, steps_done)

    async def build_proxy():
        backends = []
        for c in serving:
            b = remote_backends[c] if c in remote_backends else make_backend(cfg, layout.cells[c], params0, steps_done,
                                                                             names[c], tok)
            backends.append(faults.wrap(b) if faults is not None else b)
        # Only keys the launcher issues (one per rollout, revoked at its end) or the run's own token are
        # credentials; any model name is this policy; a harness asking more tokens than the cap gets the cap.
        return Proxy(Router(backends, wait_for_cell_s=600.0), tok, store,
                     ProxyConfig(max_tokens_cap=cfg.harness.max_tokens, clamp_max_tokens=True, model_aliases=("*",),
                                 auth_token=secrets.token_hex(16), unix_path=sock))

    sock = _socket_path(workdir, "proxy.sock")
    server = ServerThread(build_proxy)
    url = server.start()
    backends = {c: server.proxy.router.cells[names[c]] for c in serving}
    _warm_engines(cfg, server, backends, tok)

    # Adapters behind the scheduler's Protocols, and the controller.
    clock = RealClock()
    timeline = Timeline(clock, roles)
    wake = threading.Event()
    proxy_ad = ProxyAdapter(server, names, [c for c in serving if roles[c] == ROLLOUT])
    publisher = cells_lib.WeightPublisher(spec.logical_params, spec.abstract_params)
    for c in serving:  # the engines were born holding version steps_done
        if c not in remote_backends:
            publisher.publish(params0, steps_done, layout.cells[c], Role.ROLLOUT)
    publisher.history.clear()
    pool = CellPoolAdapter(layout=layout, roles=roles, backends=backends, proxy=proxy_ad, timeline=timeline,
                           notify=wake.set, publisher=publisher, published=(steps_done, params0),
                           slots=cfg.cells.max_slots, retries=cfg.cells.switch_retries, chaos=chaos,
                           remote={c: (sats.remotes[c], b) for c, b in remote_backends.items()})
    for c, b in remote_backends.items():  # a satellite that stops answering calls is taken out (its calls retried)
        b.on_unreachable = functools.partial(_take_out_later, pool, c)
    records: list[dict] = []
    c_box: dict = {}

    def on_step(info: dict) -> None:  # trainer thread: latest_params() is exactly this step's version here
        if evaluator is not None and _eval_due(cfg, info["version"]):
            info["eval_params"] = c_box["trainer"].latest_params()
        records.append(info)
        wake.set()

    def after_update(version: int) -> None:
        if ckpt.should_save(version) or version >= cfg.steps:
            save_checkpoint(ckpt, c_box["trainer"], store, s.mode, version, force=version >= cfg.steps)
        if cfg.hf_export and version >= cfg.steps:
            export_hf(cfg, c_box["trainer"].trainer.state.params, workdir, version)

    scorer = reference_lib.make_scorer(cfg, steps, core_mesh, ref_params)  # the objective's per-step pass
    print(reference_lib.describe(cfg, scorer, params0), flush=True)
    pause = functools.partial(faults_lib.pause_at_step, cfg.faults.pause_at_step) if cfg.faults.pause_at_step else None
    trainer_ad = TrainerAdapter(
        trainer=trainer, store=store, processor_config=cfg.processor_config(), groups_per_step=s.groups_per_step,
        group_size=s.group_size, micro_batch_rows=cfg.train.micro_batch_rows,
        cells=[sats.remotes[c] if sats is not None and c in sats.remotes else cell for c, cell in enumerate(layout.cells)],
        cell_roles=pool.roles, notify=wake.set, on_step=on_step, work_s_per_row=cfg.train.work_s_per_row,
        stream=stream, data_iterator=iterator, stream_groups=cfg.stream_groups, steps_done=steps_done, ready=ready,
        after_update=after_update, on_step_started=pause, on_failed_cell=pool.training_failed,
        on_pull_for_step=chaos.on_pull_for_step if chaos is not None else None, scorer=scorer,
        keep_versions=s.staleness_bound, dynamic_sampling_budget=cfg.dynamic_sampling_budget())
    c_box["trainer"] = trainer_ad
    pool.trainer = trainer_ad
    harness_loop = LoopThread()
    existing = [group_number(m.group(1)) for r in store.rollout_ids() if (m := re.match(r"(g\d+)-", r))]
    launcher = Launcher(loop=harness_loop, harness_config=cfg.harness_config(url + "/v1", RUN_ID), store=store,
                        harness=cfg.harness.make(sock), keys=server.proxy,
                        run_id=RUN_ID, task_fn=cfg.group_task, group_size=s.group_size,
                        workspace_root=os.path.join(workdir, "workspaces"),
                        on_group=trainer_ad.add_group,
                        work_s=lambda tokens: trainer_ad.work_s_per_row * max(1.0, tokens / cfg.train.row_len),
                        next_group=max(existing, default=-1) + 1,
                        launched=steps_done * s.groups_per_step + len(ready), faults=faults)
    launcher.on_error = wake.set
    launcher.resume(short)
    controller = Controller(pc, cells=pool, proxy=proxy_ad, rollouts=launcher, trainer=trainer_ad, clock=clock)
    wandb = (WandbOptions(mode=cfg.metrics.wandb, project=cfg.metrics.wandb_project, config=dataclasses.asdict(cfg))
             if cfg.metrics.wandb != "off" else None)  # the whole config copied only for a run that shows it
    metrics = MetricsWriter(workdir, purge_step=steps_done, wandb=wandb)  # metrics.jsonl, TensorBoard, W&B
    setup_s = time.perf_counter() - t_start
    how = (f" (multi-step, k={s.updates_per_publication})" if s.multi_step else
           " (groups train as they finish)" if cfg.stream_groups else
           f" (whole batches: advantage={cfg.train.advantage} normalises over the step)" if s.stream_groups else
           " (whole batches)")
    print(f"rl: mode={s.mode}{how} "
          f"cells={n_cells}x{cfg.cells.cell_size} devices, roles={''.join(r[0] for r in roles)}, "
          f"{cfg.steps} steps x {s.groups_per_step} groups x {s.group_size} rollouts, proxy {url}, "
          f"setup {setup_s:.1f}s (SFT {len(sft_history)} steps), workdir {workdir}", flush=True)
    return Components(cfg=cfg, workdir=workdir, layout=layout, trainer=trainer_ad, pool=pool, proxy=proxy_ad,
                      launcher=launcher, controller=controller, server=server, harness_loop=harness_loop, store=store,
                      ckpt=ckpt, metrics=metrics, evaluator=evaluator, timeline=timeline, clock=clock, wake=wake,
                      start=Start(steps_done, sft_history, setup_s),
                      faults=faults, chaos=chaos, records=records, warm_thread=warm, satellites=sats)


def _socket_path(workdir: str, name: str) -> str:
    """``<workdir>/<name>``, or a fresh short directory's when that is over a unix socket path's 100 bytes."""
    path = os.path.join(workdir, name)
    if len(path.encode()) <= 100:
        return path
    return os.path.join(tempfile.mkdtemp(prefix="gyre-"), name)


def _quiet_absl() -> None:
    if absl_logging.get_verbosity() >= absl_logging.INFO:  # Orbax and JetStream log every save/step at INFO
        absl_logging.set_verbosity(absl_logging.WARNING)


def _tokenizer(cfg: RLConfig):
    if not cfg.hf_path:
        return ByteTokenizer()
    return load_tokenizer(f"hf:{cfg.hf_path}", template_kwargs=dict(cfg.chat_template_kwargs))


def _take_out_later(pool: CellPoolAdapter, cell: int, why: str) -> None:
    """Take ``cell`` out of service from a thread of its own (the caller is the proxy's event loop)."""
    threading.Thread(target=pool.take_out, args=(cell, why), name=f"gyre-out-{cell}", daemon=True).start()


def _cell_steps(cfg: RLConfig) -> cells_lib.CellSteps:
    """The state spec and jitted steps of every cell: the same in every process."""
    mc, opt = cfg.model, cfg.optimizer_config()
    spec = cells_lib.StateSpec.create(functools.partial(init_boxed, mc),
                                      cells_lib.make_optimizer(opt, param_logical_axes(mc)))
    return cells_lib.CellSteps(spec, policy_loss_fn(mc, cfg.loss_config()), cells_lib.make_schedule(opt),
                               reductions=METRIC_REDUCTIONS)


def run_satellite(cfg: RLConfig, *, make_backend: BackendFactory = jetstream_backend) -> dict:
    """Process k > 0 of a multi-process rl run: cell k, serving or training on the core's word."""
    from gyre_jax.pods.rl_job import check_layout, satellite_main

    _quiet_absl()
    cfg.check_devices(len(jax.devices()))
    check_layout(cfg, cells_lib.split_cells(cfg.cell_config()))
    tok = _tokenizer(cfg)
    return satellite_main(cfg, _cell_steps(cfg), make_backend, tok)


def _eval_due(cfg: RLConfig, version: int) -> bool:
    e = cfg.eval.every
    return bool(e) and (version % e == 0 or version >= cfg.steps)


def check_checkpoint(restored, iterator) -> None:
    """A checkpoint's label is its state's policy version and its data position's step (ValueError if not)."""
    version = int(jax.device_get(restored.train_state.policy_version))
    if version != restored.step:
        raise ValueError(f"checkpoint step {restored.step} holds policy version {version}")
    if iterator.get_state()["step"] != restored.step:
        raise ValueError(f"checkpoint step {restored.step} holds data position {iterator.get_state()}")


def save_checkpoint(ckpt: Checkpointer, trainer: TrainerAdapter, store, mode: str, version: int, *,
                    force: bool) -> None:
    """State, data position, store cursor and the finished-but-untrained rollouts, as one checkpoint.

    Its label ``version`` must be the state's own policy version (a checkpoint whose label lies
    cannot be resumed: the loop refuses it at load)."""
    state_version = int(jax.device_get(trainer.trainer.state.policy_version))
    if state_version != version:
        raise RuntimeError(f"save_checkpoint: label {version} but the state is at policy version {state_version}")
    ckpt.save(version, train_state=trainer.trainer.state, store_cursor=store.cursor_state(),
              buffer=trainer.buffered_rollouts(), data_iterator=trainer.it, meta={"mode": mode}, force=force)


