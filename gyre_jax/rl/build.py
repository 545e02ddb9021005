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
from typing import Any, Callable, Mapping

import jax
import numpy as np
from absl import logging as absl_logging

from gyre_jax import cells as cells_lib
from gyre_jax.cells.loss import policy_loss_fn
from gyre_jax.cells.mesh import CellLayout, Role
from gyre_jax.distributed import ensure_cpu_devices
from gyre_jax.errors import ConfigError, RunFailed, storage_error
from gyre_jax.losses import METRIC_REDUCTIONS
from gyre_jax.model import init_boxed, init_params, param_logical_axes
from gyre_jax.cells.frozen_base import Adapted, FrozenBase
from gyre_jax.rl import faults as faults_lib
from gyre_jax.rl import lora_run
from gyre_jax.rl import reference as reference_lib
from gyre_jax.rl.cell_pool import CellPoolAdapter, ProxyAdapter, RoleTable
from gyre_jax.rl.checkpoint import CheckpointConfig, Checkpointer, abstract_like, resume_store
from gyre_jax import planner
from gyre_jax.rl.config import RLConfig
from gyre_jax.agents.sandbox import SandboxConfig
from gyre_jax.rl.episode_eval import BackgroundEval, EpisodeEval
from gyre_jax.rl.evaluate import HeldOutEval, first_call_prompt
from gyre_jax.rl.launcher import Group, Launcher, ResumedGroup, group_number, resume_plan
from gyre_jax.rl.metrics import MetricsWriter, WandbOptions
from gyre_jax.rl.runtime import LoopThread, RealClock, Timeline
from gyre_jax.rl import warm_cache
from gyre_jax.rl.sft import demo_trees, noisy_tasks, warm_start
from gyre_jax.rl.step_events import TrainerSnapshot
from gyre_jax.rl.trainer import TrainerAdapter
from gyre_jax.scheduler import costs_file
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
    metrics: MetricsWriter
    evaluator: HeldOutEval | BackgroundEval | lora_run.AdapterEvals | None
    timeline: Timeline
    clock: RealClock
    wake: threading.Event
    start: Start
    faults: faults_lib.RLFaults | None
    chaos: faults_lib.Chaos | None
    evals: list[dict] = dataclasses.field(default_factory=list)  # held-out eval results, appended by the loop
    warm_thread: threading.Thread | None = None
    satellites: Any = None  # gyre_jax.pods.rl_job.Satellites when the cells run in separate processes
    task_check: dict = dataclasses.field(default_factory=dict)  # what the grader check at start found (task_gate)

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
    policy: Any  # scheduler.policy.PolicyConfig
    steps: cells_lib.CellSteps
    core_mesh: Any
    warm_thread: threading.Thread  # compiling every cell's training step meanwhile
    evaluator: HeldOutEval | BackgroundEval | lora_run.AdapterEvals | None
    frozen: FrozenBase | None = None  # a LoRA run's base (rl/lora_run.py); None: the params are the model's
    base_history: tuple[dict, ...] = ()  # the SFT warm start's metrics when the LoRA base was made now


@dataclasses.dataclass(frozen=True)
class Restored:
    """The train state: the last checkpoint's (with its data position and buffered rollouts) or a fresh model's."""

    ckpt: Checkpointer
    stream: RowStream
    iterator: Any  # the grain iterator over ``stream``, at the state's step
    trainer: cells_lib.ElasticTrainer
    steps_done: int
    ready: tuple[Group, ...]  # finished groups to train first
    short: tuple[ResumedGroup, ...]  # groups a stop cut short: their missing rollouts run again
    ref_params: Any  # KL's target, or None
    sft_history: tuple[dict, ...]
    resumed: bool


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


def _hf_params(cfg: RLConfig, mesh):
    from gyre_jax.model.hf import load_pretrained

    mc = cfg.model
    loaded, params = load_pretrained(cfg.hf_path, mesh=mesh, dtype=mc.param_dtype,
                                     vocab_pad_multiple=mc.vocab_pad_multiple, max_seq_len=mc.max_seq_len)
    if loaded.replace(remat=mc.remat, dtype=mc.dtype, logits_temperature=mc.logits_temperature) != mc:
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


def _make_eval(cfg: RLConfig, tok, frozen: FrozenBase | None = None) -> HeldOutEval | lora_run.AdapterEvals | None:
    """The first-call held-out eval (config.eval.kind=first_call), or None (off, or whole episodes:
    ``_episode_eval`` builds that one once the cells exist)."""
    e = cfg.eval
    if not e.every or e.kind != "first_call":
        return None
    def held_out(tasks, prepare=None):
        return HeldOutEval(cfg.model, tasks, tok, system_prompt=cfg.harness.system_prompt or None,
                           samples_per_task=e.samples_per_task, max_tokens=cfg.harness.max_tokens,
                           temperature=e.temperature, seed=cfg.seed, max_len=cfg.cells.max_len,
                           sandbox=SandboxConfig(kind=cfg.harness.sandbox), prepare=prepare)

    try:
        if frozen is not None and cfg.train.lora.adapters > 1:  # each adapter on each adapter's task set
            return lora_run.AdapterEvals([held_out(src.eval_tasks(e.tasks)) for src in cfg.adapter_sources], frozen)
        tasks = cfg.task_source.eval_tasks(e.tasks)  # disjoint from the RL and SFT tasks
        return held_out(tasks, None if frozen is None else functools.partial(lora_run.merged, frozen))
    except ValueError as err:
        raise ConfigError(f"config.eval: {err}") from None


def _episode_eval(cfg: RLConfig, tok, cell, make_backend: BackendFactory, workdir: str,
                  frozen: FrozenBase | None = None) -> BackgroundEval:
    """Whole-episode held-out eval (config.eval.kind=episodes) on its own engine on ``cell``, on a thread."""
    e = cfg.eval
    # As many episodes in flight as the eval engine has decode slots: multi-call episodes spend most of
    # their time in tools and test suites, so a group's worth in flight leaves the engine idle.
    # A longer deadline than the rollouts': a loaded machine (this run's own training) must not score as the
    # policy's timeouts (on Dec 4 a third of the warm start's eval episodes timed out beside RL's start).
    hc = cfg.harness_config("http://127.0.0.1:1/v1")
    hc = dataclasses.replace(hc, temperature=e.temperature, deadline_s=hc.deadline_s * e.deadline_scale,
                             deadline_scale=hc.deadline_scale * e.deadline_scale,
                             concurrency=max(cfg.scheduler.group_size, cfg.cells.max_slots))
    ev = EpisodeEval(tasks=cfg.task_source.eval_tasks(e.tasks), samples_per_task=e.samples_per_task,
                     pass_score=e.pass_score, harness_config=hc, make_harness=cfg.harness.make,
                     make_backend=lambda params, version: make_backend(cfg, cell, _engine_params(frozen, params),
                                                                       version, "eval", tok),
                     tokenizer=tok, workdir=os.path.join(workdir, "eval"), seed=cfg.seed,
                     max_tokens_cap=cfg.harness.max_tokens, start_timeout_s=cfg.cells.start_timeout_s)
    return BackgroundEval(ev, log_dir=os.path.join(workdir, "eval"), on_close=(ev.close,))


def _warm_steps(steps, cs, cfg: RLConfig) -> None:
    """Compile grad_step on every cell's training mesh (and the core's update) ahead of use:
    a satellite joining a step would otherwise compile while holding a micro-batch."""
    from gyre_jax.trajectory.binpack import pack_trees
    from gyre_jax.trajectory.node import TreeNode

    t = cfg.train
    tree = TreeNode.span([1, 2, 3], children=[TreeNode.span([4, 5], trainable=True)])
    mb = pack_trees([tree], [0.0], t.row_len, min_rows=t.micro_batch_rows,
                    routing_width=cfg.model.routing_width).rows.as_dict()  # the run's batches' fields
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
    return dataclasses.replace(c, start=Start(restored.steps_done, restored.sft_history, setup_s))


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
    return Base(workdir=workdir, multi=multi, n_cells=n_cells, store=store, tok=tok, costs=own_costs(workdir))


def own_costs(workdir: str) -> policy_lib.Measured | None:
    """The scheduler costs an earlier attempt in ``workdir`` measured (None: none did), read after the store's
    lock says no other run writes them."""
    path = os.path.join(workdir, costs_file.FILE_NAME)
    if not os.path.exists(path):
        return None
    try:
        return costs_file.load(path)
    except ValueError as e:
        raise ConfigError(f"--workdir: {e}; delete it to let this run measure its costs afresh") from None


def save_costs(workdir: str, controller: Controller) -> None:
    """``<workdir>/scheduler_costs.json``: what the controller has measured (each step; a pilot's, a resume's)."""
    if controller.estimates is None:
        return
    path = os.path.join(workdir, costs_file.FILE_NAME)
    measured = controller.estimates.measured()
    moves: list = getattr(controller.cells, "moves", lambda: [])()
    if moves:  # the weight move inside a switch, so a run that moves other bytes can rescale it (costs.for_move_bytes)
        measured = dataclasses.replace(measured, move_bytes=float(np.mean([m.bytes for m in moves])),
                                       move_s=float(np.mean([m.seconds for m in moves])))
    try:
        costs_file.save(path, measured)
    except OSError as e:
        raise storage_error(path, "writing the scheduler costs", e) from e


def build_placement(cfg: RLConfig, base: Base, make_backend: BackendFactory) -> Placement:
    """Cells and roles, the jitted steps (compiling on a thread of their own while set-up goes on) and the
    held-out eval (whole episodes get an engine on the core cell's devices)."""
    pc = cfg.policy_config(base.n_cells, own_costs=base.costs)
    roles = tuple(policy_lib.initial_roles(pc, base.n_cells))
    cs = cells_lib.split_cells(cfg.cell_config())
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
    evaluator: HeldOutEval | BackgroundEval | lora_run.AdapterEvals | None = _make_eval(cfg, base.tok, frozen)
    if cfg.eval.every and cfg.eval.kind == "episodes":
        evaluator = _episode_eval(cfg, base.tok, layout.cells[0], make_backend, base.workdir, frozen)
    steps = _cell_steps(cfg, frozen)
    # Each satellite process compiles its own cell's step; a run that fails during set-up must not wait for these.
    warm = threading.Thread(target=_warm_steps, args=(steps, cs[:1] if base.multi else cs, cfg), name="gyre-warm",
                            daemon=True)
    warm.start()  # compile every cell's training step while SFT and set-up run
    return Placement(layout=layout, roles=roles, policy=pc, steps=steps, core_mesh=layout.role_to_mesh()[Role.CORE][0],
                     warm_thread=warm, evaluator=evaluator, frozen=frozen, base_history=tuple(base_history))


def restore_or_init(cfg: RLConfig, base: Base, place: Placement) -> Restored:
    """The last checkpoint (state, data position, buffered rollouts), or a fresh model warm-started by SFT."""
    ckpt = Checkpointer(CheckpointConfig(directory=os.path.join(base.workdir, "checkpoints"), max_to_keep=2,
                                         save_interval_steps=cfg.checkpoint_every or cfg.steps,
                                         this_process_only=base.multi))  # pods: the core alone owns and saves
    spec, mesh = place.steps.spec, place.core_mesh
    stream = RowStream(cfg.train.row_len)
    iterator = iter(StreamingDataset(stream, batch_size=cfg.train.micro_batch_rows, seed=cfg.seed))
    restored = ckpt.restore_latest(abstract_like(spec.abstract_state(), spec.state_shardings(mesh)),
                                   data_iterator=iterator, validate=lambda r: check_checkpoint(r, iterator, place.frozen))
    sft_history: list[dict] = []
    ready: list[Group] = []
    short: list[ResumedGroup] = []
    if restored is not None:
        state, steps_done = restored.train_state, restored.step
        ready, short = _resume_groups(cfg, base.store, restored)
        ref_params = reference_lib.restore_reference(cfg, base.workdir, place.steps, mesh)
    else:
        if place.frozen is not None:  # LoRA: the base was made with the placement; the params are the adapters
            params, sft_history = lora_run.initial_adapters(cfg, cfg.seed), list(place.base_history)
        else:
            params, sft_history = fresh_params(cfg, base.tok, mesh)
        ref_params = reference_lib.keep_reference(cfg, base.workdir, params, place.steps, mesh)  # KL's target
        state, steps_done = spec.state_from_params(params, mesh), 0
        # The starting policy as checkpoint 0, before any rollout runs: a stop before the first periodic
        # checkpoint resumes from it, so what that attempt finished is trained (else no checkpoint means a
        # fresh start that never reads the store's finished rollouts: all lost) and the warm start is kept.
        save_checkpoint(ckpt, TrainerSnapshot(state=state, buffered_rollouts=(), data_iterator=iterator), base.store,
                        cfg.scheduler.mode, 0, force=True, frozen=place.frozen)
    if iterator.get_state()["step"] != steps_done:
        raise RunFailed(f"checkpoint step {steps_done} but its data position is {iterator.get_state()}")
    trainer = cells_lib.ElasticTrainer(place.steps, place.layout.core, state)
    if trainer.version != steps_done:
        raise RunFailed(f"checkpoint step {steps_done} != policy version {trainer.version}")
    if isinstance(place.evaluator, BackgroundEval):  # eval.jsonl keeps the lineage's versions; none evaluated twice
        place.evaluator.start(resume_step=steps_done if restored is not None else None)
    if steps_done >= cfg.steps:
        print(f"rl: already at step {steps_done} >= steps={cfg.steps}; nothing to do", flush=True)
    return Restored(ckpt=ckpt, stream=stream, iterator=iterator, trainer=trainer, steps_done=steps_done,
                    ready=tuple(ready), short=tuple(short), ref_params=ref_params, sft_history=tuple(sft_history),
                    resumed=restored is not None)


def _resume_groups(cfg: RLConfig, store: TrajectoryStore, restored):
    """A resumed run's (ready, short) groups: the buffered ones to train, the ones a stop cut short."""
    steps_done = restored.step
    pending = resume_store(store, restored)
    ready, short = resume_plan(store, RUN_ID, cfg.scheduler.group_size, steps_done, pending)
    damaged = store.damaged_rollouts()
    if damaged:  # their rollouts are unfinished: resume_plan gives them an outcome and runs their slots again
        log.warning("rl: the store lost records of %d rollouts to damage: %s", len(damaged),
                    {r: d.reason for r, d in list(damaged.items())[:10]})
    print(f"rl: resumed from checkpoint step {steps_done} ({sum(len(g.rollout_ids) for g in ready)} finished "
          f"rollouts to train in {len(ready)} groups; {len(short)} groups cut short by the stop get their "
          f"{sum(len(g.rerun) for g in short)} missing rollouts run again)", flush=True)
    return ready, short


def build_serving(cfg: RLConfig, base: Base, place: Placement, restored: Restored,
                  make_backend: BackendFactory) -> Serving:
    """An engine on every cell that may serve (born holding the starting policy), the router and the
    recording proxy on their server thread, every engine warmed up."""
    faults = faults_lib.RLFaults(cfg.faults) if cfg.faults.any else None
    chaos = faults_lib.Chaos(cfg.faults) if cfg.faults.chaos else None
    s = cfg.scheduler
    serving = _serving_cells(s.mode, base.n_cells, s.async_train_cells)
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
    _warm_engines(cfg, server, backends, base.tok)
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
    (hands finished groups to the trainer), the controller. Nothing is started here but the harness loop."""
    s, steps_done = cfg.scheduler, restored.steps_done
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
    store = base.store
    existing = [group_number(m.group(1)) for r in store.rollout_ids() if (m := re.match(r"(g\d+)-", r))]
    launcher = Launcher(loop=harness_loop, harness_config=cfg.harness_config(serving.url + "/v1", RUN_ID), store=store,
                        harness=cfg.harness.make(serving.sock), keys=serving.server.proxy, run_id=RUN_ID,
                        task_fn=cfg.group_task, group_size=s.group_size,
                        workspace_root=os.path.join(base.workdir, "workspaces"), on_group=trainer_ad.add_group,
                        work_s=functools.partial(trainer_ad.work_s, row_len=cfg.train.row_len),
                        next_group=max(existing, default=-1) + 1,
                        launched=steps_done * s.groups_per_step + len(restored.ready), faults=serving.faults,
                        on_error=wake.set, failure_window=s.groups_per_step * s.group_size)
    launcher.resume(list(restored.short))
    controller = Controller(place.policy, cells=pool, proxy=proxy_ad, rollouts=launcher, trainer=trainer_ad,
                            clock=clock)
    if base.costs is not None and controller.estimates is not None:
        controller.estimates.restore(base.costs)  # a resumed run goes on measured, not blind
    wandb = (WandbOptions(mode=cfg.metrics.wandb, project=cfg.metrics.wandb_project, config=dataclasses.asdict(cfg))
             if cfg.metrics.wandb != "off" else None)  # the whole config copied only for a run that shows it
    metrics = MetricsWriter(base.workdir, purge_step=steps_done, wandb=wandb)  # metrics.jsonl, TensorBoard, W&B
    return Components(cfg=cfg, workdir=base.workdir, layout=place.layout, trainer=trainer_ad, pool=pool,
                      proxy=proxy_ad, launcher=launcher, controller=controller, server=serving.server,
                      harness_loop=harness_loop, store=store, ckpt=restored.ckpt, metrics=metrics,
                      evaluator=place.evaluator, timeline=timeline, clock=clock, wake=wake,
                      start=Start(steps_done, restored.sft_history, 0.0), faults=serving.faults, chaos=serving.chaos,
                      warm_thread=place.warm_thread, satellites=serving.satellites)


def _trainer_adapter(cfg: RLConfig, base: Base, place: Placement, restored: Restored, serving: Serving,
                     table: RoleTable, wake: threading.Event) -> TrainerAdapter:
    """The trainer behind the scheduler's Protocol: finished groups -> rows -> elastic steps, a checkpoint after
    each update that is due one (and the HF export after the last)."""
    s, workdir, store = cfg.scheduler, base.workdir, base.store
    ckpt, sats = restored.ckpt, serving.satellites

    def after_update(version: int, snap: TrainerSnapshot) -> None:  # the trainer thread, between steps
        if ckpt.should_save(version) or version >= cfg.steps:
            save_checkpoint(ckpt, snap, store, s.mode, version, force=version >= cfg.steps, frozen=place.frozen)
        if place.frozen is not None and version >= cfg.steps:  # the adapters as PEFT directories: small, always
            lora_run.export_peft(cfg, snap.state.params, workdir, version)
        if cfg.hf_export and version >= cfg.steps:
            export_hf(cfg, snap.state.params if place.frozen is None else
                      lora_run.merged(place.frozen, snap.state.params), workdir, version)

    # A rewind past the staleness bound leaves more groups due by the next S steps than they hold at G each:
    # those steps take more (policy.resume_step_sizes), so every group trains within the bound.
    sizes = policy_lib.resume_step_sizes([g.version for g in restored.ready] + [g.version for g in restored.short],
                              restored.steps_done, place.policy)
    if sizes.groups:
        print(f"resume: steps {sizes.first}..{sizes.first + len(sizes.groups) - 1} take {sizes.groups[0]} groups "
              f"each (not {s.groups_per_step}): {len(restored.ready) + len(restored.short)} groups are due by them "
              "(the rewind went past the staleness bound)", flush=True)
    scorer = reference_lib.make_scorer(cfg, place.steps, place.core_mesh, restored.ref_params)  # the per-step pass
    print(reference_lib.describe(cfg, scorer, restored.trainer.state.params), flush=True)
    if place.frozen is not None:
        print(lora_run.describe(cfg, place.frozen, restored.trainer.state.params), flush=True)
    pause = functools.partial(faults_lib.pause_at_step, cfg.faults.pause_at_step) if cfg.faults.pause_at_step else None
    chaos = serving.chaos
    cells = [sats.remotes[c] if sats is not None and c in sats.remotes else cell
             for c, cell in enumerate(place.layout.cells)]
    return TrainerAdapter(
        trainer=restored.trainer, store=store, processor_config=cfg.processor_config(),
        groups_per_step=s.groups_per_step, group_size=s.group_size, micro_batch_rows=cfg.train.micro_batch_rows,
        cells=cells, cell_roles=table.all, notify=wake.set, work_s_per_row=cfg.train.work_s_per_row,
        stream=restored.stream, data_iterator=restored.iterator, stream_groups=cfg.stream_groups,
        steps_done=restored.steps_done, ready=restored.ready, after_update=after_update, on_step_started=pause,
        restored_rollouts=frozenset(r for g in restored.ready for r in g.rollout_ids)
        | {r for g in restored.short for r in g.finished},
        on_pull_for_step=chaos.on_pull_for_step if chaos is not None else None, scorer=scorer,
        keep_versions=s.staleness_bound, dynamic_sampling_budget=cfg.dynamic_sampling_budget(), step_sizes=sizes,
        adapter_of=_adapter_of_group(cfg))


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
    mc, opt = cfg.policy_model, cfg.optimizer_config()
    # Expert parallelism is a training layout only: the loss dispatches over the training mesh's 'expert'
    # axis; engines run the same params with every expert on the serving mesh (no 'expert' axis there).
    loss_model = mc.replace(expert_parallel_axis="expert") if cfg.cells.train_expert > 1 else mc
    loss_model = loss_model.replace(routing_replay=cfg.train.routing_replay)  # engines never replay: they record
    if frozen is not None:
        return lora_run.cell_steps(cfg, frozen, loss_model)
    spec = cells_lib.StateSpec.create(functools.partial(init_boxed, mc),
                                      cells_lib.make_optimizer(opt, param_logical_axes(mc)))
    return cells_lib.CellSteps(spec, policy_loss_fn(loss_model, cfg.loss_config()), cells_lib.make_schedule(opt),
                               reductions=METRIC_REDUCTIONS)


def run_satellite(cfg: RLConfig, *, workdir: str | None = None, make_backend: BackendFactory = jetstream_backend) -> dict:
    """Process k > 0 of a multi-process rl run: cell k, serving or training on the core's word. A LoRA run's
    satellite reads the frozen base the core keeps in ``workdir`` (rl/lora_run.py: a shared filesystem, or
    model.hf_path itself); everything the core sends it afterwards is adapters."""
    from gyre_jax.pods.rl_job import check_layout, satellite_main

    _quiet_absl()
    cfg.check_devices(len(jax.devices()))
    check_layout(cfg, cells_lib.split_cells(cfg.cell_config()))
    tok = _tokenizer(cfg)
    frozen = None
    if cfg.train.lora.enabled:
        if workdir is None:
            raise ConfigError("a LoRA run's satellite process needs the run's --workdir (the core keeps the base there)")
        frozen = lora_run.satellite_base(cfg, os.path.abspath(workdir), lambda: (_hf_params(cfg, None), []))
    return satellite_main(cfg, _cell_steps(cfg, frozen), make_backend, tok)


def check_checkpoint(restored, iterator, frozen: FrozenBase | None = None) -> None:
    """A checkpoint's label is its state's policy version and its data position's step, and a LoRA run's
    adapters were trained on this base (ValueError if not)."""
    if frozen is not None:
        lora_run.check_resume(restored.meta, frozen)
    version = int(jax.device_get(restored.train_state.policy_version))
    if version != restored.step:
        raise ValueError(f"checkpoint step {restored.step} holds policy version {version}")
    if iterator.get_state()["step"] != restored.step:
        raise ValueError(f"checkpoint step {restored.step} holds data position {iterator.get_state()}")


def save_checkpoint(ckpt: Checkpointer, snap: TrainerSnapshot, store, mode: str, version: int, *,
                    force: bool, frozen: FrozenBase | None = None) -> None:
    """State, data position, store cursor and the finished-but-untrained rollouts, as one checkpoint.

    Its label ``version`` must be the state's own policy version (a checkpoint whose label lies
    cannot be resumed: the loop refuses it at load)."""
    state_version = int(jax.device_get(snap.state.policy_version))
    if state_version != version:
        raise RuntimeError(f"save_checkpoint: label {version} but the state is at policy version {state_version}")
    ckpt.save(version, train_state=snap.state, store_cursor=store.cursor_state(),
              buffer=list(snap.buffered_rollouts), data_iterator=snap.data_iterator, force=force,
              meta={"mode": mode} if frozen is None else {"mode": mode, lora_run.META_KEY: frozen.fingerprint()})
