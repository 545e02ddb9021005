"""RLConfig: every knob of the RL loop, as frozen kw_only dataclasses built from the ConfigDict.

``RLConfig.from_config(config_dict)`` turns ``configs/demo.py``'s ConfigDict (after
absl ``--config.a.b=v`` overrides) into these; an unknown key fails loudly, a bad
value fails in ``__post_init__`` naming the field.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Mapping

from gyre_jax.model import ModelConfig

from gyre_jax.scheduler.vocab import MODES  # the scheduler owns the policy modes


def _positive(obj, names, *, allow_zero=False):
    w = type(obj).__name__
    for n in names:
        v = getattr(obj, n)
        ok = v >= 0 if allow_zero else v > 0
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not ok:
            raise ValueError(f"{w}.{n} must be {'>= 0' if allow_zero else '> 0'}, got {v!r}")


@dataclasses.dataclass(frozen=True, kw_only=True)
class CellsConfig:
    cell_size: int = 2  # devices per cell (8 CPU devices -> 4 cells)
    train_tensor: int = 1
    serve_tensor: int = 1  # 1: slots split over the cell's devices ('data'), weights replicated
    max_slots: int = 8  # concurrent decode slots per engine (one engine per cell)
    max_len: int = 256  # KV-cache length per slot (prompt + generated)
    tokens_per_call: int = 1  # decode steps per engine generate call (GyreEngine: amortizes host work)

    def __post_init__(self):
        _positive(self, ("cell_size", "train_tensor", "serve_tensor", "max_slots", "max_len", "tokens_per_call"))


@dataclasses.dataclass(frozen=True, kw_only=True)
class SchedulerConfig:
    mode: str = "elastic"  # one of MODES (the scheduler's policy modes)
    groups_per_step: int = 2  # G: groups trained per optimizer step
    group_size: int = 4  # rollouts per group (advantage baseline)
    staleness_bound: int = 1  # S: admission bound, in optimizer updates
    async_train_cells: int = 1  # async modes: cells 0..k-1 train (k >= 1)
    min_work_per_switch_s: float = 0.5  # elastic: cell-seconds of work that pay for a switch
    serve_reserve: float = 1.0
    poll_s: float = 0.05  # controller tick period (it also wakes on every event)

    def __post_init__(self):
        if self.mode not in MODES:
            raise ValueError(f"SchedulerConfig.mode={self.mode!r}; known: {MODES}")
        _positive(self, ("groups_per_step", "group_size", "async_train_cells", "serve_reserve", "poll_s"))
        _positive(self, ("staleness_bound", "min_work_per_switch_s"), allow_zero=True)


@dataclasses.dataclass(frozen=True, kw_only=True)
class TaskConfig:
    family: str = "tiny"  # gyre_jax.agents.tasks family
    ops: str = "copy,upper,reverse"  # tiny family: comma-separated ops
    min_len: int = 3
    max_len: int = 4

    def __post_init__(self):
        _positive(self, ("min_len", "max_len"))
        if not self.ops_tuple:
            raise ValueError("TaskConfig.ops must name at least one op")

    @property
    def ops_tuple(self) -> tuple[str, ...]:
        return tuple(o.strip() for o in self.ops.split(",") if o.strip())

    def kwargs(self) -> dict:
        if self.family == "tiny":
            return dict(ops=self.ops_tuple, min_len=self.min_len, max_len=self.max_len)
        return {}


@dataclasses.dataclass(frozen=True, kw_only=True)
class HarnessKnobs:
    max_tokens: int = 96  # per model call
    temperature: float = 1.0
    max_turns: int = 2  # model calls per agent
    deadline_s: float = 60.0  # per rollout
    request_timeout_s: float = 60.0
    max_retries: int = 2
    backoff_base_s: float = 0.05
    grader_timeout_s: float = 30.0
    system_prompt: str = ""  # overrides the task's system prompt when non-empty (shorter contexts)

    def __post_init__(self):
        _positive(self, ("max_tokens", "max_turns", "deadline_s", "request_timeout_s", "grader_timeout_s"))
        _positive(self, ("temperature", "max_retries", "backoff_base_s"), allow_zero=True)


@dataclasses.dataclass(frozen=True, kw_only=True)
class TrainConfig:
    row_len: int = 256  # packed row length L
    micro_batch_rows: int = 2  # rows per micro-batch (one compiled shape)
    learning_rate: float = 3e-4
    warmup_steps: int = 0
    weight_decay: float = 0.0
    max_grad_norm: float = 1.0
    adam_b2: float = 0.999
    adam_eps: float = 1e-8  # larger values damp Adam's full-size steps on rarely-seen tokens' rows
    eps_low: float = 0.2
    eps_high: float = 0.28
    entropy_coef: float = 0.0
    advantage: str = "mean_std"  # gyre_jax.trajectory.rewards modes
    # Multiplies negative advantages (trajectory.rewards.AdvantageConfig.negative_scale):
    # 1.0 = plain group-normalized policy gradient, 0.0 = reinforce only better-than-group.
    negative_advantage_scale: float = 1.0
    work_s_per_row: float = 0.05  # initial estimate of training cell-seconds per row (then measured)

    def __post_init__(self):
        _positive(self, ("row_len", "micro_batch_rows", "learning_rate", "max_grad_norm", "work_s_per_row", "adam_eps"))
        if not 0 <= self.adam_b2 < 1:
            raise ValueError(f"TrainConfig.adam_b2 must be in [0, 1), got {self.adam_b2}")
        _positive(self, ("warmup_steps", "weight_decay", "eps_low", "eps_high", "entropy_coef",
                         "negative_advantage_scale"), allow_zero=True)


NOISE_KINDS = ("reverse", "one_char", "random", "give_up")  # gyre_jax.rl.sft.noisy_tasks


@dataclasses.dataclass(frozen=True, kw_only=True)
class SFTConfig:
    steps: int = 300  # supervised steps on scripted demonstrations (0: no warm start)
    rows: int = 4  # packed rows per step
    learning_rate: float = 3e-3
    demos: int = 512  # distinct demonstration tasks (cycled)
    # Fraction of demonstrations that are deliberately bad (a wrong answer, or giving up;
    # 'tiny' family only, see gyre_jax.rl.sft.noisy_tasks). 0 = clean.
    # > 0 is meant to leave the warm-started policy right only part of the time (headroom
    # and reward variance for RL); measured results in configs/demo.py's docstring.
    noisy_fraction: float = 0.0
    noisy_kind: str = "reverse"  # how a demonstration is bad: reverse | one_char | random | give_up

    def __post_init__(self):
        _positive(self, ("steps", "demos"), allow_zero=True)
        _positive(self, ("rows", "learning_rate"))
        if not 0.0 <= self.noisy_fraction < 1.0:
            raise ValueError(f"SFTConfig.noisy_fraction must be in [0, 1), got {self.noisy_fraction!r}")
        if self.noisy_kind not in NOISE_KINDS:
            raise ValueError(f"SFTConfig.noisy_kind={self.noisy_kind!r}; known: {NOISE_KINDS}")


@dataclasses.dataclass(frozen=True, kw_only=True)
class EvalConfig:
    """Held-out eval (gyre_jax.rl.evaluate): the first model call of fixed tasks, fixed sampling key."""

    every: int = 0  # evaluate after every k-th step (and before the first, after the last); 0 = off
    tasks: int = 32  # held-out tasks, seeds 2**29 + s (RL draws seed*1_000_003 + g, SFT 2**30 + s)
    samples_per_task: int = 8
    temperature: float = 1.0  # 0 = greedy; default = the harness's rollout temperature

    def __post_init__(self):
        _positive(self, ("every",), allow_zero=True)
        _positive(self, ("tasks", "samples_per_task"))
        _positive(self, ("temperature",), allow_zero=True)


@dataclasses.dataclass(frozen=True, kw_only=True)
class FaultConfig:
    """Injected faults for tests (0 = off). Every k-th rollout launched (1-based) gets it."""

    grader_crash_every: int = 0  # its grader raises -> verifier_error
    timeout_every: int = 0  # its calls stall past the deadline -> timeout, graded for partial credit
    engine_error_every: int = 0  # its first model call fails in the engine -> 500, the harness retries
    # Not a rollout fault: the trainer prints "PAUSED <step>" once that step (0-based, so
    # step 0 cannot be paused) has started on the cells and blocks before its update is
    # kept or checkpointed, so a test can kill -9 the run mid-step (tests/test_rl_resume.py).
    pause_at_step: int = 0

    def __post_init__(self):
        _positive(self, ("grader_crash_every", "timeout_every", "engine_error_every", "pause_at_step"),
                  allow_zero=True)

    @property
    def any(self) -> bool:
        """Whether rollouts are marked and backends wrapped (RLFaults); the pause needs neither."""
        return bool(self.grader_crash_every or self.timeout_every or self.engine_error_every)


@dataclasses.dataclass(frozen=True, kw_only=True)
class RLConfig:
    seed: int = 0
    steps: int = 20  # optimizer steps (N)
    num_cpu_devices: int = 8  # host devices when running on CPU (set before JAX starts)
    first_last: int = 5  # steps averaged for the "reward first vs last" line
    checkpoint_every: int = 0  # save every k steps (0 = only at the end)
    progress: bool = True  # tqdm bar
    model: ModelConfig
    cells: CellsConfig = CellsConfig()
    scheduler: SchedulerConfig = SchedulerConfig()
    task: TaskConfig = TaskConfig()
    harness: HarnessKnobs = HarnessKnobs()
    train: TrainConfig = TrainConfig()
    sft: SFTConfig = SFTConfig()
    eval: EvalConfig = EvalConfig()
    faults: FaultConfig = FaultConfig()

    def __post_init__(self):
        _positive(self, ("steps", "num_cpu_devices", "first_last"))
        _positive(self, ("checkpoint_every",), allow_zero=True)
        if self.train.row_len > self.model.max_seq_len:
            raise ValueError(f"RLConfig: train.row_len={self.train.row_len} > model.max_seq_len={self.model.max_seq_len}")
        if self.cells.max_len > self.model.max_seq_len:
            raise ValueError(f"RLConfig: cells.max_len={self.cells.max_len} > model.max_seq_len={self.model.max_seq_len}")
        fsdp = self.cells.cell_size // self.cells.train_tensor
        if self.train.micro_batch_rows % fsdp:
            raise ValueError(f"RLConfig: train.micro_batch_rows={self.train.micro_batch_rows} must be a multiple of the "
                             f"cells' fsdp size cell_size/train_tensor={fsdp} (rows are split over it)")
        if self.harness.max_tokens >= self.cells.max_len:
            raise ValueError(f"RLConfig: harness.max_tokens={self.harness.max_tokens} must be < cells.max_len")

    @classmethod
    def from_config(cls, config: Any) -> "RLConfig":
        d = config.to_dict() if hasattr(config, "to_dict") else dict(config)
        d = {k: v for k, v in d.items() if k not in ("job", "workdir")}
        nested = dict(model=ModelConfig, cells=CellsConfig, scheduler=SchedulerConfig, task=TaskConfig,
                      harness=HarnessKnobs, train=TrainConfig, sft=SFTConfig, eval=EvalConfig,
                      faults=FaultConfig)
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(d) - known)
        if unknown:
            raise ValueError(f"RL config: unknown field(s) {unknown}; known: {sorted(known)}")
        kw = {}
        for k, v in d.items():
            if k in nested:
                kw[k] = _build(nested[k], v, k)
            else:
                kw[k] = v
        if "model" not in kw:
            raise ValueError("RL config: 'model' is required")
        return cls(**kw)


def _build(klass, value: Mapping[str, Any], where: str):
    names = {f.name for f in dataclasses.fields(klass)}
    unknown = sorted(set(value) - names)
    if unknown:
        raise ValueError(f"RL config {where}: unknown field(s) {unknown}; known: {sorted(names)}")
    return klass(**dict(value))
