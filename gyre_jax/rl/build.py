"""``build(config) -> Components``: every part of the RL loop, made once and started. Wiring only.

The cells and their layout (the trainer and the engines are placed from its role ->
mesh map), the train state (the last checkpoint with its data position and buffered
rollouts, or a fresh model: ``rl.start_policy``), the engines on the serving cells
behind the router and the recording proxy (warmed up: ``rl.warmup``), the harness
launcher (finishing groups a stop cut short), the grain pipeline that feeds the
trainer, the scheduler's controller over adapters of all of them, and the hooks that
run after each update (the checkpoint, ``rl.checkpointing``; the HF export,
``rl.export``) and after each step's record (the held-out eval, ``rl.evaluators``;
the metrics; the scheduler's costs file). ``gyre_jax.rl.loop.drive`` runs them.
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
from typing import Any, Callable, Mapping

import jax
from absl import logging as absl_logging

from gyre_jax import cells as cells_lib
from gyre_jax import planner
from gyre_jax.cells.frozen_base import Adapted, FrozenBase
from gyre_jax.cells.loss import policy_loss_fn
from gyre_jax.cells.mesh import CellLayout, Role
from gyre_jax.distributed import ensure_cpu_devices
from gyre_jax.errors import ConfigError, RunFailed
from gyre_jax.losses import METRIC_REDUCTIONS
from gyre_jax.model import init_boxed, param_logical_axes
from gyre_jax.rl import faults as faults_lib
from gyre_jax.rl import heap, lora_run
from gyre_jax.rl import reference as reference_lib
from gyre_jax.rl import replay as replay_lib
from gyre_jax.rl.cell_pool import CellPoolAdapter, ProxyAdapter, RoleTable
from gyre_jax.rl.checkpoint import Checkpointer, abstract_like
from gyre_jax.rl.checkpointing import CheckpointHook, check_checkpoint, open_checkpointer, save_checkpoint
from gyre_jax.rl.config import RLConfig
from gyre_jax.rl.evaluate import first_call_prompt
from gyre_jax.rl.evaluators import Evaluator, make_evaluator
from gyre_jax.rl.export import ExportHook, PeftExportHook
from gyre_jax.rl.group_queue import GroupQueue
from gyre_jax.rl.groups import Group, WorkEstimate
from gyre_jax.rl.hooks import StepHooks, StepInfo, UpdateHooks
from gyre_jax.rl.launcher import Launcher, ResumedGroup, group_number
from gyre_jax.rl.metrics import MetricsWriter
from gyre_jax.rl.report import scalars
from gyre_jax.rl.runtime import LoopThread, RealClock, Timeline
from gyre_jax.rl.start_policy import fresh_params, hf_params
from gyre_jax.rl.step_events import TrainerSnapshot
from gyre_jax.rl.step_processor import StepProcessor
from gyre_jax.rl.step_runner import StepRunner
from gyre_jax.rl.trainer import TrainerAdapter
from gyre_jax.rl.warmup import warm_engines, warm_steps
from gyre_jax.scheduler import costs_file
from gyre_jax.scheduler import policy as policy_lib
from gyre_jax.scheduler.config import SchedulerConfig
from gyre_jax.scheduler.controller import Controller
from gyre_jax.scheduler.modes import get_mode
from gyre_jax.scheduler.vocab import ROLLOUT
from gyre_jax.schema import plain
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
                        version=version, name=name, special_ids=special, tokens_per_call=c.tokens_per_call,
                        kv_cache=c.kv_cache, page_size=c.page_size, kv_pages=c.kv_pages or None,
                        lora_serving=cfg.train.lora.serving,  # a LoRA run's params: Adapted(base, adapters)
                        prefill_chunk=c.prefill_chunk, fixed_prefill=c.fixed_prefill)
    # The prefix cache (each rollout's last call's k/v, for its next call) is bounded at one full slot's k/v per
    # decode slot: what the memory plan counts for it (planner.prefix_cache_bytes). 64 entries of up to max_len
    # each, unbounded in bytes, took a SmolLM2 run 0.8 GiB over its plan.
    return JetStreamBackend(engine, name=name, prefix_cache_bytes=planner.prefix_cache_bytes(cfg.model, c))


@dataclasses.dataclass(frozen=True)
class Start:
    """Where this run starts: a checkpoint's step, or a fresh (warm-started) model."""

    steps_done: int
    sft_history: tuple[dict, ...]  # the warm start's per-step metrics (empty on resume)
    setup_s: float


@dataclasses.dataclass(frozen=True)
class Components:
    """Every part of a started run, as ``drive`` uses it (the builders below make them in order)."""

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
    checkpoints: CheckpointHook  # its save_after_failure: what a failing run trained
    metrics: MetricsWriter
    evaluator: Evaluator | None
    step_hooks: StepHooks  # after each step's record: the eval, the heap trim, the metrics, the costs file
    timeline: Timeline
    clock: RealClock
    wake: threading.Event
    start: Start
    faults: faults_lib.RLFaults | None
    chaos: faults_lib.Chaos | None
    warm_thread: threading.Thread | None = None
    satellites: Any = None  # gyre_jax.pods.rl_job.Satellites when the cells run in separate processes
    task_check: dict = dataclasses.field(default_factory=dict)  # what the grader check at start found (task_gate)

    def close(self) -> None:
        """Stop every thread and server; each part closes even if another fails to."""
        sats = () if self.satellites is None else (self.satellites.stop,)  # after the trainer and proxy stopped
        evals = (self.evaluator.close,) if self.evaluator is not None else ()
        for stop in (self.trainer.stop, self.launcher.close, self.pool.close, self.server.stop, self.harness_loop.stop,
                     *sats, *evals, self.ckpt.close, self.metrics.close, self.store.close):
            try:
                stop()
            except Exception as e:  # noqa: BLE001 - close the rest; one line (a failing run already says why)
                log.error("closing %s failed: %s: %s", getattr(stop, "__qualname__", stop), type(e).__name__, e)
        if self.warm_thread is not None:
            self.warm_thread.join(60)


@dataclasses.dataclass(frozen=True)
class Base:
    """The run's footing: its directory, store (whose lock says nobody else runs here), tokenizer, cells."""

    workdir: str
    multi: bool  # pods: this is process 0, the core; cell k runs in process k
    n_cells: int
    store: TrajectoryStore
    tok: Any
    costs: policy_lib.Measured | None = None  # what an earlier attempt in this workdir measured (costs_file)


@dataclasses.dataclass(frozen=True)
class Placement:
    """The cells and who does what on them: the layout's role -> mesh map places the trainer and engines."""

    layout: CellLayout
    roles: tuple[str, ...]  # the policy's initial roles
    policy: SchedulerConfig  # config.scheduler, with this workdir's own measured costs
    steps: cells_lib.CellSteps
    core_mesh: Any
    warm_thread: threading.Thread  # compiling every cell's training step meanwhile
    evaluator: Evaluator | None
    frozen: FrozenBase | None = None  # a LoRA run's base (rl/lora_run.py); None: the params are the model's
    base_history: tuple[dict, ...] = ()  # the SFT warm start's metrics when the LoRA base was made now


@dataclasses.dataclass(frozen=True)
class Restored:
    """The train state: the last checkpoint's (with its data position and buffered rollouts) or a fresh model's."""

    ckpt: Checkpointer
    stream: RowStream
    iterator: Any  # the grain iterator over ``stream``, at the state's step
    trainer: cells_lib.ElasticTrainer
    steps_done: int  # after a resume's replay (rl.replay)
    ready: tuple[Group, ...]  # finished groups to train first
    short: tuple[ResumedGroup, ...]  # groups a stop cut short: their missing rollouts run again
    ref_params: Any  # KL's target, or None
    sft_history: tuple[dict, ...]
    resumed: bool
    update_hooks: UpdateHooks  # after each update (the replay's and the run's): the checkpoint, the exports
    checkpoints: CheckpointHook  # its save_after_failure: what a failing run trained
    checkpoint_step: int = 0  # the restored checkpoint's step: the first this attempt records
    replayed: tuple = ()  # StepDone of each step the resume trained again from its record
    scorer: Any = None  # the per-step pass (cells.score.StepScorer), or None
    versions: Mapping[int, Any] = dataclasses.field(default_factory=dict)  # params the replay kept for it


@dataclasses.dataclass(frozen=True)
class Serving:
    """Engines on the cells that may serve, behind the router and the recording proxy (started)."""

    server: ServerThread
    url: str
    sock: str
    names: Mapping[int, str]  # serving cell -> its engine's name in the router
    backends: Mapping[int, Any]  # serving cell -> its backend (the router's)
    remote_backends: Mapping[int, Any]  # pods: the satellites' engines
    satellites: Any
    publisher: cells_lib.WeightPublisher
    faults: faults_lib.RLFaults | None
    chaos: faults_lib.Chaos | None


# ---------------------------------------------------------------------------- build
def build(cfg: RLConfig, workdir: str, *, make_backend: BackendFactory = jetstream_backend) -> Components:
    """Every part of the loop, started; ``drive`` runs it. ``make_backend`` puts an engine on a cell.

    Built in data-flow order, each builder taking what the earlier ones made (no part refers back to
    a later one): the footing, the placement, the train state, the serving side, then the control side
    (roles, trainer, pool, launcher, controller), and only then are its threads started."""
    t_start = time.perf_counter()
    base = build_base(cfg, workdir)
    place = build_placement(cfg, base, make_backend)
    restored = restore_or_init(cfg, base, place)
    serving = build_serving(cfg, base, place, restored, make_backend)
    c = build_control(cfg, base, place, restored, serving)
    c.harness_loop.start()
    c.trainer.start()
    setup_s = time.perf_counter() - t_start
    _describe(cfg, base, place, serving, restored, setup_s)
    return dataclasses.replace(c, start=Start(restored.checkpoint_step, restored.sft_history, setup_s))


def build_base(cfg: RLConfig, workdir: str) -> Base:
    """The workdir, the devices' cells, the store (first: its writer lock says whether another run owns this
    workdir, before any work starts) and the tokenizer."""
    _quiet_absl()
    workdir = os.path.abspath(workdir)
    os.makedirs(workdir, exist_ok=True)
    multi = jax.process_count() > 1  # pods: this is process 0, the core; cell k runs in process k
    if not multi:
        ensure_cpu_devices(cfg.num_cpu_devices)
    n_cells = cfg.check_devices(len(jax.devices()))
    planner.check_local(cfg, jax.devices())  # a layout that cannot fit its devices stops here, in one line
    try:
        store = TrajectoryStore(os.path.join(workdir, "store"), run_id=RUN_ID,
                                config=StoreConfig(vocab_size=cfg.model.vocab_size))
    except StoreBusy as e:
        raise ConfigError(f"--workdir={os.path.dirname(workdir)}: another run is using it ({e}); stop that run "
                          "or choose another --workdir") from None
    tok = _tokenizer(cfg)
    if tok.vocab_size > cfg.model.vocab_size:
        raise ConfigError(f"config.model.vocab_size={cfg.model.vocab_size} < the tokenizer's {tok.vocab_size} ids")
    return Base(workdir=workdir, multi=multi, n_cells=n_cells, store=store, tok=tok, costs=costs_file.load_own(workdir))


def build_placement(cfg: RLConfig, base: Base, make_backend: BackendFactory) -> Placement:
    """Cells and roles, the jitted steps (compiling on a thread of their own while set-up goes on) and the
    held-out eval (whole episodes get an engine on the core cell's devices)."""
    policy = cfg.policy(base.costs)
    policy.check_cells(base.n_cells, cfg.cells.cell_size)
    roles = tuple(policy_lib.initial_roles(policy, base.n_cells))
    cs = cells_lib.split_cells(cfg.cells)
    if base.multi:
        from gyre_jax.pods.rl_job import check_layout

        check_layout(cfg, cs)
    layout = CellLayout(cs, (Role.CORE,) + tuple(Role.ROLLOUT if r == ROLLOUT else Role.TRAIN for r in roles[1:]))
    frozen: FrozenBase | None = None
    base_history: list[dict] = []
    if cfg.train.lora.enabled:  # the base first: the cells' steps read it (rl/lora_run.py)
        core_mesh = layout.role_to_mesh()[Role.CORE][0]
        frozen, base_history = lora_run.frozen_base(cfg, base.workdir,
                                                    lambda: fresh_params(cfg, base.tok, core_mesh))
    evaluator = make_evaluator(cfg, base.tok, layout.cells[0], make_backend, base.workdir, frozen)
    steps = _cell_steps(cfg, frozen)
    # Each satellite process compiles its own cell's step; a run that fails during set-up must not wait for these.
    t = cfg.train
    warm = threading.Thread(target=warm_steps, args=(steps, cs[:1] if base.multi else cs), name="gyre-warm",
                            kwargs=dict(row_len=t.row_len, micro_batch_rows=t.micro_batch_rows,
                                        routing_width=t.routing_width), daemon=True)
    warm.start()  # compile every cell's training step while SFT and set-up run
    return Placement(layout=layout, roles=roles, policy=policy, steps=steps,
                     core_mesh=layout.role_to_mesh()[Role.CORE][0], warm_thread=warm, evaluator=evaluator,
                     frozen=frozen, base_history=tuple(base_history))


def restore_or_init(cfg: RLConfig, base: Base, place: Placement) -> Restored:
    """The last checkpoint (state, data position, buffered rollouts; the steps its rewind removed replayed from
    their records), or a fresh model warm-started by SFT; and the hooks after each update (the checkpoints)."""
    ckpt = open_checkpointer(base.workdir, every=cfg.checkpoint_every, steps=cfg.steps,
                             this_process_only=base.multi)  # pods: the core alone owns and saves
    spec, mesh = place.steps.spec, place.core_mesh
    stream = RowStream(cfg.train.row_len)
    iterator = iter(StreamingDataset(stream, batch_size=cfg.train.micro_batch_rows, seed=cfg.seed))
    restored = ckpt.restore_latest(abstract_like(spec.abstract_state(), spec.state_shardings(mesh)),
                                   data_iterator=iterator, validate=lambda r: check_checkpoint(r, iterator, place.frozen))
    sft_history: list[dict] = []
    if restored is not None:
        state, steps_done = restored.train_state, restored.step
        ref_params = reference_lib.restore_reference(cfg, base.workdir, place.steps, mesh)
    else:
        state, ref_params, sft_history = _fresh_state(cfg, base, place, ckpt, iterator)
        steps_done = 0
    if iterator.get_state()["step"] != steps_done:
        raise RunFailed(f"checkpoint step {steps_done} but its data position is {iterator.get_state()}")
    trainer = cells_lib.ElasticTrainer(place.steps, place.layout.core, state)
    if trainer.version != steps_done:
        raise RunFailed(f"checkpoint step {steps_done} != policy version {trainer.version}")
    if place.evaluator is not None:  # eval.jsonl keeps the lineage's versions; none evaluated twice
        place.evaluator.start(steps_done if restored is not None else None)
    scorer = reference_lib.make_scorer(cfg, place.steps, mesh, ref_params)  # the per-step pass
    print(reference_lib.describe(cfg, scorer, trainer.state.params), flush=True)
    if place.frozen is not None:
        print(lora_run.describe(cfg, place.frozen, trainer.state.params), flush=True)
    update_hooks, checkpoints = _update_hooks(cfg, base, ckpt, place.frozen)
    fresh = Restored(ckpt=ckpt, stream=stream, iterator=iterator, trainer=trainer, steps_done=steps_done, ready=(),
                     short=(), ref_params=ref_params, sft_history=tuple(sft_history), resumed=restored is not None,
                     checkpoint_step=steps_done, scorer=scorer, update_hooks=update_hooks, checkpoints=checkpoints)
    out = _resume(cfg, base, place, fresh, restored) if restored is not None else fresh
    if out.steps_done >= cfg.steps:
        print(f"rl: already at step {out.steps_done} >= steps={cfg.steps}; nothing to do", flush=True)
    return out


def _fresh_state(cfg: RLConfig, base: Base, place: Placement, ckpt: Checkpointer, iterator):
    """A fresh run's (state, KL's reference params, the warm start's history), saved as checkpoint 0."""
    spec, mesh = place.steps.spec, place.core_mesh
    if place.frozen is not None:  # LoRA: the base was made with the placement; the params are the adapters
        params, sft_history = lora_run.initial_adapters(cfg, cfg.seed), list(place.base_history)
    else:
        params, sft_history = fresh_params(cfg, base.tok, mesh)
    ref_params = reference_lib.keep_reference(cfg, base.workdir, params, place.steps, mesh)  # KL's target
    state = spec.state_from_params(params, mesh)
    # The starting policy as checkpoint 0, before any rollout runs: a stop before the first periodic
    # checkpoint resumes from it, so what that attempt finished is trained (else no checkpoint means a
    # fresh start that never reads the store's finished rollouts: all lost) and the warm start is kept.
    save_checkpoint(ckpt, TrainerSnapshot(state=state, buffered_rollouts=(), data_iterator=iterator), base.store,
                    cfg.scheduler.mode, 0, force=True, frozen=place.frozen)
    return state, ref_params, sft_history


def _resume(cfg: RLConfig, base: Base, place: Placement, r: Restored, checkpoint) -> Restored:
    """A resumed run: the steps the rewind removed trained again from their records (``rl.replay``, on the
    core alone, before any rollout runs; the update hooks after each), then the finished groups to train and
    the ones a stop cut short."""
    s, store = cfg.scheduler, base.store
    processor = StepProcessor(store=store, config=cfg.train, stream=r.stream,
                              micro_batch_rows=cfg.train.micro_batch_rows, group_size=s.group_size, scorer=r.scorer,
                              adapter_of=_adapter_of_group(cfg))
    runner = StepRunner(trainer=r.trainer, store=store, iterator=r.iterator, inputs=processor.outbox,
                        micro_batch_rows=cfg.train.micro_batch_rows, groups_per_step=s.groups_per_step,
                        cells=place.layout.cells, cell_roles=list, work=WorkEstimate(cfg.train.work_s_per_row),
                        keep_versions=_keep_versions(cfg, r.scorer), after_update=r.update_hooks.after_update)
    processor.params_of = runner.params_of
    got = replay_lib.resume_with_replay(store, checkpoint, workdir=base.workdir, run_id=RUN_ID,
                                        group_size=s.group_size, last_step=cfg.steps, processor=processor,
                                        runner=runner)
    damaged = store.damaged_rollouts()
    if damaged:  # their rollouts are unfinished: resume_plan gives them an outcome and runs their slots again
        log.warning("rl: the store lost records of %d rollouts to damage: %s", len(damaged),
                    {k: d.reason for k, d in list(damaged.items())[:10]})
    replayed = (f"; replayed steps {got.checkpoint_step}..{got.steps_done - 1} from their records"
                if got.replayed else "")
    print(f"rl: resumed from checkpoint step {got.checkpoint_step} ({sum(len(g.rollout_ids) for g in got.ready)} "
          f"finished rollouts to train in {len(got.ready)} groups; {len(got.short)} groups cut short by the stop get "
          f"their {sum(len(g.rerun) for g in got.short)} missing rollouts run again){replayed}", flush=True)
    return dataclasses.replace(r, steps_done=got.steps_done, ready=got.ready, short=got.short,
                               checkpoint_step=got.checkpoint_step, replayed=got.replayed,
                               versions=runner.kept_versions())


def _keep_versions(cfg: RLConfig, scorer) -> int:
    """Versions whose params the per-step pass reads: the staleness bound's, when a mismatch correction needs them."""
    return cfg.scheduler.staleness_bound if scorer is not None and scorer.needed and scorer.keeps_versions else 0


def build_serving(cfg: RLConfig, base: Base, place: Placement, restored: Restored,
                  make_backend: BackendFactory) -> Serving:
    """An engine on every cell that may serve (born holding the starting policy), the router and the
    recording proxy on their server thread, every engine warmed up."""
    faults = faults_lib.RLFaults(cfg.faults) if cfg.faults.any else None
    chaos = faults_lib.Chaos(cfg.faults) if cfg.faults.chaos else None
    s = cfg.scheduler
    serving = list(get_mode(s.mode).serving_cells(base.n_cells, s.async_train_cells))  # each gets an engine
    names = {c: f"cell{c}" for c in serving}
    params0, version = restored.trainer.state.params, restored.steps_done
    engine_params0 = _engine_params(place.frozen, params0)  # a LoRA run's engines get the base once, here
    sats, remote_backends = None, {}
    if base.multi:  # the satellite processes' cells: training handles, and engines built on the starting policy
        from gyre_jax.pods.rl_job import Satellites

        sats = Satellites(place.steps, place.core_mesh)
        remote_backends = sats.start_engines(params0, version)
    sock = _socket_path(base.workdir, "proxy.sock")

    async def build_proxy():
        backends = []
        for c in serving:
            b = remote_backends[c] if c in remote_backends else make_backend(cfg, place.layout.cells[c],
                                                                             engine_params0, version, names[c],
                                                                             base.tok)
            backends.append(faults.wrap(b) if faults is not None else b)
        # Only keys the launcher issues (one per rollout, revoked at its end) or the run's own token are
        # credentials; any model name is this policy; a harness asking more tokens than the cap gets the cap.
        proxy = Proxy(Router(backends, wait_for_cell_s=600.0), base.tok, base.store,
                      ProxyConfig(max_tokens_cap=cfg.harness.max_tokens, clamp_max_tokens=True, model_aliases=("*",),
                                  auth_token=secrets.token_hex(16), unix_path=sock))
        group_adapter = _adapter_of_group(cfg)
        if group_adapter is not None:  # multi-LoRA: a call samples with its rollout's adapter, found by its key
            proxy.adapter_of = lambda b: group_adapter(b.group_id)
        return proxy

    server = ServerThread(build_proxy)
    url = server.start(cfg.cells.start_timeout_s, "the rollout engines")
    backends = {c: server.proxy.router.cells[names[c]] for c in serving}
    warm_engines(server, backends, first_call_prompt(cfg.group_task(0), base.tok, cfg.harness.system_prompt))
    spec = place.steps.spec
    publisher = cells_lib.WeightPublisher(spec.logical_params, spec.abstract_params)
    for c in serving:  # the engines were born holding version steps_done
        if c not in remote_backends:
            publisher.publish(params0, version, place.layout.cells[c], Role.ROLLOUT)
    publisher.history.clear()
    return Serving(server=server, url=url, sock=sock, names=names, backends=backends, remote_backends=remote_backends,
                   satellites=sats, publisher=publisher, faults=faults, chaos=chaos)


def build_control(cfg: RLConfig, base: Base, place: Placement, restored: Restored, serving: Serving) -> Components:
    """The adapters behind the scheduler's Protocols and the controller over them, in the order that lets each
    take the ones it calls: the role table, the trainer, the cell pool (asks the trainer), the launcher
    (hands finished groups to the trainer), the controller; then the step hooks. Nothing is started here but
    the harness loop."""
    steps_done = restored.steps_done
    clock, wake = RealClock(), threading.Event()
    timeline = Timeline(clock, list(place.roles))
    table = RoleTable(place.roles, timeline, wake.set)
    proxy_ad = ProxyAdapter(serving.server, dict(serving.names), [c for c in serving.names if place.roles[c] == ROLLOUT])
    trainer_ad = _trainer_adapter(cfg, base, place, restored, serving, table, wake)
    remote = {c: (serving.satellites.remotes[c], b) for c, b in serving.remote_backends.items()}
    pool = CellPoolAdapter(layout=place.layout, roles=table, trainer=trainer_ad, backends=dict(serving.backends),
                           proxy=proxy_ad, notify=wake.set, publisher=serving.publisher,
                           published=(steps_done, restored.trainer.state.params), slots=cfg.cells.max_slots,
                           retries=cfg.cells.switch_retries, chaos=serving.chaos, remote=remote)
    for c, b in serving.remote_backends.items():  # a satellite that stops answering calls is taken out (retried)
        b.on_unreachable = functools.partial(_take_out_later, pool, c)
    harness_loop = LoopThread()
    launcher = _launcher(cfg, base, restored, serving, trainer_ad, harness_loop, wake)
    controller = Controller(place.policy, cells=pool, proxy=proxy_ad, rollouts=launcher, trainer=trainer_ad,
                            clock=clock)
    if base.costs is not None and controller.estimates is not None:
        controller.estimates.restore(base.costs)  # a resumed run goes on measured, not blind
    # metrics.jsonl and the sinks it names; from the checkpoint's step: the replayed steps are recorded again
    metrics = MetricsWriter(base.workdir, purge_step=restored.checkpoint_step, sinks=cfg.metrics.sink_options,
                            run_config=plain(cfg))
    return Components(cfg=cfg, workdir=base.workdir, layout=place.layout, trainer=trainer_ad, pool=pool,
                      proxy=proxy_ad, launcher=launcher, controller=controller, server=serving.server,
                      harness_loop=harness_loop, store=base.store, ckpt=restored.ckpt, checkpoints=restored.checkpoints,
                      metrics=metrics, evaluator=place.evaluator,
                      step_hooks=_step_hooks(cfg, base.workdir, place.evaluator, controller, metrics),
                      timeline=timeline, clock=clock, wake=wake,
                      start=Start(restored.checkpoint_step, restored.sft_history, 0.0),
                      faults=serving.faults, chaos=serving.chaos, warm_thread=place.warm_thread,
                      satellites=serving.satellites)


def _update_hooks(cfg: RLConfig, base: Base, ckpt: Checkpointer,
                  frozen: FrozenBase | None) -> tuple[UpdateHooks, CheckpointHook]:
    """After each optimizer update, on the trainer's thread: a checkpoint every checkpoint_every-th (and after the
    last); after the last, a LoRA run's adapters as PEFT directories, and the HF export."""
    checkpoints = CheckpointHook(ckpt, base.store, cfg.scheduler.mode, frozen)
    hooks = UpdateHooks(cfg.steps)
    hooks.add_hook(checkpoints.on_update, every=cfg.checkpoint_every, name="checkpoint")
    if frozen is not None:  # small: always
        hooks.add_hook(PeftExportHook(cfg, base.workdir).on_update, every=0, name="peft_export")
    if cfg.hf_export:
        hooks.add_hook(ExportHook(cfg, base.workdir, frozen).on_update, every=0, name="hf_export")
    return hooks, checkpoints


def _step_hooks(cfg: RLConfig, workdir: str, evaluator: Evaluator | None, controller: Controller,
                metrics: MetricsWriter) -> StepHooks:
    """After each step's record, on the loop's thread, in this order: the held-out eval (its numbers join the
    record), the heap trim, the metrics writer (the whole record), the scheduler's costs file (the next run's
    priors, --config.scheduler.priors, and a resume's start)."""
    hooks = StepHooks(cfg.steps)
    if evaluator is not None:
        hooks.add_hook(lambda info: evaluator.evaluate(info.version, info.params), every=cfg.eval.every,
                       name="eval")
    hooks.add_hook(_heap_hook(), name="heap")
    hooks.add_hook(lambda info: metrics.write(info.record.step, scalars(info.record)), name="metrics")
    estimates = controller.estimates
    if estimates is not None:
        moves: Callable[[], list] = getattr(controller.cells, "moves", lambda: [])
        hooks.add_hook(lambda info: costs_file.save_own(workdir, estimates.measured(), moves()), name="costs")
    return hooks


def _heap_hook() -> Callable[[StepInfo], dict]:
    """Freed heap back to the OS when much is held (its numbers join the record)."""
    trimmer = heap.HeapTrimmer()
    return lambda info: trimmer.after_step()


def _launcher(cfg: RLConfig, base: Base, restored: Restored, serving: Serving, trainer_ad: TrainerAdapter,
              harness_loop: LoopThread, wake: threading.Event) -> Launcher:
    """The harness launcher, going on from the groups the store holds (a stop's cut-short ones first)."""
    s, store = cfg.scheduler, base.store
    existing = [group_number(m.group(1)) for r in store.rollout_ids() if (m := re.match(r"(g\d+)-", r))]
    launcher = Launcher(loop=harness_loop, store=store, harness=cfg.harness.make(serving.sock),
                        harness_config=dataclasses.replace(cfg.harness, base_url=serving.url + "/v1", run_id=RUN_ID),
                        keys=serving.server.proxy, run_id=RUN_ID, task_fn=cfg.group_task, group_size=s.group_size,
                        workspace_root=os.path.join(base.workdir, "workspaces"), on_group=trainer_ad.add_group,
                        work_s=functools.partial(trainer_ad.work_s, row_len=cfg.train.row_len),
                        next_group=max(existing, default=-1) + 1,
                        launched=restored.steps_done * s.groups_per_step + len(restored.ready), faults=serving.faults,
                        on_error=wake.set, failure_window=s.groups_per_step * s.group_size)
    launcher.resume(list(restored.short))
    return launcher


def _trainer_adapter(cfg: RLConfig, base: Base, place: Placement, restored: Restored, serving: Serving,
                     table: RoleTable, wake: threading.Event) -> TrainerAdapter:
    """The trainer behind the scheduler's Protocol, its three parts wired (``rl/trainer.py``: the group queue, the
    step processor, the step runner), the update hooks after each update."""
    s, store = cfg.scheduler, base.store
    sats, chaos = serving.satellites, serving.chaos
    # A rewind past the staleness bound leaves more groups due by the next S steps than they hold at G each:
    # those steps take more (policy.resume_step_sizes), so every group trains within the bound.
    sizes = policy_lib.resume_step_sizes([g.version for g in restored.ready] + [g.version for g in restored.short],
                                         restored.steps_done, place.policy)
    if sizes.groups:
        print(f"resume: steps {sizes.first}..{sizes.first + len(sizes.groups) - 1} take {sizes.groups[0]} groups "
              f"each (not {s.groups_per_step}): {len(restored.ready) + len(restored.short)} groups are due by them "
              "(the rewind went past the staleness bound)", flush=True)
    pause = functools.partial(faults_lib.pause_at_step, cfg.faults.pause_at_step) if cfg.faults.pause_at_step else None
    cells = [sats.remotes[c] if sats is not None and c in sats.remotes else cell
             for c, cell in enumerate(place.layout.cells)]
    work = WorkEstimate(cfg.train.work_s_per_row)
    # The finished rollouts a resume found untrained: their tokens sampled past the version it reached count
    # as sampled by it (launcher.lineage_version).
    redate = {r: restored.steps_done for g in restored.ready for r in g.rollout_ids}
    redate.update({r: restored.steps_done for g in restored.short for r in g.finished})
    queue = GroupQueue(store=store, advantage=cfg.train, groups_per_step=s.groups_per_step,
                       stream_groups=cfg.stream_groups, send=lambda ev: processor.inbox.put(ev), notify=wake.set,
                       work=work, steps_done=restored.steps_done, ready=restored.ready, step_sizes=sizes,
                       dynamic_sampling_budget=cfg.dynamic_sampling_budget(), calls_of=functools.partial(_calls, store))
    processor = StepProcessor(store=store, config=cfg.train, stream=restored.stream,
                              micro_batch_rows=cfg.train.micro_batch_rows, group_size=s.group_size, redate=redate,
                              scorer=restored.scorer, on_processed=queue.processed, adapter_of=_adapter_of_group(cfg))
    runner = StepRunner(trainer=restored.trainer, store=store, iterator=restored.iterator, inputs=processor.outbox,
                        micro_batch_rows=cfg.train.micro_batch_rows, groups_per_step=s.groups_per_step, cells=cells,
                        cell_roles=table.all, work=work, keep_versions=_keep_versions(cfg, restored.scorer),
                        after_update=restored.update_hooks.after_update, on_step_started=pause,
                        on_pull_for_step=chaos.on_pull_for_step if chaos is not None else None,
                        versions=dict(restored.versions))
    processor.params_of = runner.params_of
    return TrainerAdapter(queue, processor, runner, replayed=restored.replayed)


def _calls(store, rid: str) -> list:
    try:
        return store.calls(rid)
    except KeyError:  # a rollout that never reached the model
        return []


def _adapter_of_group(cfg: RLConfig):
    """Multi-LoRA: a group id's adapter ("g00012" -> 12 % adapters; another id, the run's own warm-up calls: 0);
    None with one adapter."""
    if cfg.train.lora.adapters == 1:
        return None

    def adapter_of(group_id: str) -> int:
        m = re.fullmatch(r"g(\d+)", group_id or "")
        return cfg.group_adapter(int(m.group(1))) if m else 0

    return adapter_of


def _engine_params(frozen: FrozenBase | None, params):
    """What a new engine is given: the params, or a LoRA run's base with its adapters."""
    return params if frozen is None else Adapted(frozen, params)


def _describe(cfg: RLConfig, base: Base, place: Placement, serving: Serving, restored: Restored,
              setup_s: float) -> None:
    s = cfg.scheduler
    how = (f" (multi-step, k={s.updates_per_publication})" if s.multi_step else
           " (groups train as they finish)" if cfg.stream_groups else
           f" (whole batches: advantage={cfg.train.advantage} normalises over the step)" if s.stream_groups else
           " (whole batches)")
    print(f"rl: mode={s.mode}{how} "
          f"cells={base.n_cells}x{cfg.cells.cell_size} devices, roles={''.join(r[0] for r in place.roles)}, "
          f"{cfg.steps} steps x {s.groups_per_step} groups x {s.group_size} rollouts, proxy {serving.url}, "
          f"setup {setup_s:.1f}s (SFT {len(restored.sft_history)} steps), workdir {base.workdir}", flush=True)


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


def _cell_steps(cfg: RLConfig, frozen: FrozenBase | None = None) -> cells_lib.CellSteps:
    """The state spec and jitted steps of every cell: the same in every process. ``frozen``: a LoRA run's
    base (the state is then its adapters: rl/lora_run.py)."""
    mc, opt = cfg.policy_model, cfg.train  # the train section is the optimizer's config and the loss's
    # Expert parallelism is a training layout only: the loss dispatches over the training mesh's 'expert'
    # axis; engines run the same params with every expert on the serving mesh (no 'expert' axis there).
    loss_model = mc.replace(expert_parallel_axis="expert") if cfg.cells.train_expert > 1 else mc
    loss_model = loss_model.replace(routing_replay=cfg.train.routing_replay)  # engines never replay: they record
    if frozen is not None:
        return lora_run.cell_steps(cfg, frozen, loss_model)
    spec = cells_lib.StateSpec.create(functools.partial(init_boxed, mc),
                                      cells_lib.make_optimizer(opt, param_logical_axes(mc)))
    return cells_lib.CellSteps(spec, policy_loss_fn(loss_model, cfg.train), cells_lib.make_schedule(opt),
                               reductions=METRIC_REDUCTIONS)


def run_satellite(cfg: RLConfig, *, workdir: str | None = None, make_backend: BackendFactory = jetstream_backend) -> dict:
    """Process k > 0 of a multi-process rl run: cell k, serving or training on the core's word. A LoRA run's
    satellite reads the frozen base the core keeps in ``workdir`` (rl/lora_run.py: a shared filesystem, or
    model.hf_path itself); everything the core sends it afterwards is adapters."""
    from gyre_jax.pods.rl_job import check_layout, satellite_main

    _quiet_absl()
    cfg.check_devices(len(jax.devices()))
    check_layout(cfg, cells_lib.split_cells(cfg.cells))
    tok = _tokenizer(cfg)
    frozen = None
    if cfg.train.lora.enabled:
        if workdir is None:
            raise ConfigError("a LoRA run's satellite process needs the run's --workdir (the core keeps the base there)")
        frozen = lora_run.satellite_base(cfg, os.path.abspath(workdir), lambda: (hf_params(cfg, None), []))
    return satellite_main(cfg, _cell_steps(cfg, frozen), make_backend, tok)


