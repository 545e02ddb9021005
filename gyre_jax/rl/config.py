"""RLConfig: every knob of the RL loop, as frozen kw_only dataclasses built from the ConfigDict.

``RLConfig.from_config(config_dict)`` turns ``configs/demo.py``'s ConfigDict (after
absl ``--config.a.b=v`` overrides) into these. Validation is complete and early:
every object the loop builds later from the config (the scheduler's policy, the
advantage and processor configs, the loss, the optimizer, the cells, the harness,
the task family, the SFT data) is built here too, so a bad value fails in seconds,
before any JAX work, as a ``ConfigError`` whose message starts with the field's
dotted name (``config.scheduler.serve_reserve=2 must be in (0, 1]``).
"""
from __future__ import annotations

import dataclasses
import importlib.util
import functools
import os
import re
from typing import Any, ClassVar, Mapping

from gyre_jax.errors import ConfigError
from gyre_jax.model import ModelConfig
from gyre_jax.scheduler.policy import DEFAULT_MIN_WORK_PER_SWITCH_S, DEFAULT_SERVE_RESERVE
from gyre_jax.scheduler.modes import get_mode, mode_names  # the scheduler owns the policy modes
from gyre_jax.scheduler.vocab import ELASTIC


def section(cls, **overrides) -> dict:
    """Every field of a config section (e.g. ``HarnessKnobs``) with its default, then ``overrides``:
    what a ``configs/*.py`` file puts in its ConfigDict, so every field can be overridden from the
    command line (``--config.harness.kind=command``) and the defaults live in one place."""
    names = {f.name for f in dataclasses.fields(cls)}
    bad = sorted(set(overrides) - names)
    if bad:
        raise unknown_fields(cls.SECTION, bad, names)
    out = {}
    for f in dataclasses.fields(cls):
        if f.default is not dataclasses.MISSING:
            out[f.name] = f.default
        elif f.default_factory is not dataclasses.MISSING:
            out[f.name] = f.default_factory()
    out.update(overrides)
    return {k: dict(v) if isinstance(v, Mapping) else v for k, v in out.items()}


def unknown_fields(where: str, unknown, known) -> ConfigError:
    """The error for fields a section does not have, each with its nearest known field when one is close
    (``config.scheduler: unknown field(s) ['modee'] (did you mean 'mode'?)``)."""
    import difflib

    known = sorted(known)
    hints = [f"{u!r} -> {m[0]!r}" for u in unknown if (m := difflib.get_close_matches(u, known, n=1, cutoff=0.6))]
    if len(unknown) == 1 and hints:
        near = f" (did you mean {hints[0].split(' -> ')[1]}?)"
    else:
        near = f" (did you mean: {', '.join(hints)})" if hints else ""
    return ConfigError(f"config{'.' + where if where else ''}: unknown field(s) {sorted(unknown)}{near}; known: {known}")


def _positive(obj, names, *, allow_zero=False):
    for n in names:
        v = getattr(obj, n)
        ok = v >= 0 if allow_zero else v > 0
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not ok:
            raise ConfigError(f"config.{obj.SECTION}.{n} must be {'>= 0' if allow_zero else '> 0'}, got {v!r}")


def _ints(obj, names):
    for n in names:
        v = getattr(obj, n)
        if isinstance(v, bool) or not isinstance(v, int):
            raise ConfigError(f"config.{obj.SECTION}.{n} must be an int, got {v!r}")


def _built(section: str, build):
    """``build()``, with any error re-raised as a ConfigError naming the config field.

    Sub-configs name their own fields (``PolicyConfig.serve_reserve=2 ...``), and a knob has one
    name from flag to field, so the class is all that changes: ``config.scheduler.serve_reserve``.
    """
    try:
        return build()
    except ConfigError:
        raise
    except (ValueError, LookupError, TypeError) as e:
        msg = str(e).strip("'\"")
        named = re.sub(r"\b[A-Z]\w*Config\.(?=\w)", f"config.{section}.", msg)
        raise ConfigError(named if named != msg else f"config.{section}: {msg}") from None


@dataclasses.dataclass(frozen=True, kw_only=True)
class CellsConfig:
    SECTION: ClassVar[str] = "cells"
    cell_size: int = 2  # devices per cell (8 CPU devices -> 4 cells)
    train_tensor: int = 1
    train_expert: int = 1  # > 1: training mesh ('fsdp', 'expert', 'tensor'); an MoE model's experts split over 'expert'
    serve_tensor: int = 1  # 1: slots split over the cell's devices ('data'), weights replicated
    serve_expert: int = 1  # > 1: serving mesh ('data', 'expert', 'tensor'); an MoE model's experts split over 'expert'
    max_slots: int = 16  # concurrent decode slots per engine (one engine per cell)
    max_len: int = 160  # KV-cache length per slot (prompt + generated)
    tokens_per_call: int = 8  # decode steps per engine generate call (GyreEngine: amortizes host work)
    # "contiguous": max_slots x max_len preallocated (the default until paged has run a whole RL
    # job on an accelerator); "paged": pages of page_size tokens for live tokens only, calls
    # admitted by free pages (GyreEngine, serving/pages.py).
    kv_cache: str = "contiguous"
    page_size: int = 16  # tokens per KV page (paged); max_len must be a multiple
    kv_pages: int = 0  # pages per engine (paged); 0 = the contiguous cache's memory (max_slots x max_len)
    switch_retries: int = 2  # a role switch or weight load that raises is retried this often, then the cell is taken out
    # Engines (weights placed, decode steps compiled) must be serving within this many seconds of the start, or
    # the run ends with an error: line (exit 1) instead of hanging; a loaded 2-core host compiles slowly.
    start_timeout_s: float = 300.0
    # Prompts longer than prefill_chunk (a power of two) prefill chunk by chunk. fixed_prefill: every prompt does,
    # into a max_len buffer: one prefill program for every prompt and cached prefix (GyreEngine.fixed_prefill).
    prefill_chunk: int = 4096
    fixed_prefill: bool = False

    def __post_init__(self):
        _ints(self, ("cell_size", "train_tensor", "train_expert", "serve_tensor", "serve_expert", "max_slots",
                     "max_len", "tokens_per_call", "switch_retries", "page_size", "kv_pages", "prefill_chunk"))
        if self.prefill_chunk < 16 or self.prefill_chunk & (self.prefill_chunk - 1):
            raise ConfigError(f"config.cells.prefill_chunk must be a power of two >= 16, got {self.prefill_chunk}")
        if self.fixed_prefill and self.prefill_chunk > self.max_len:
            raise ConfigError(f"config.cells.fixed_prefill: prefill_chunk={self.prefill_chunk} must be at most "
                              f"cells.max_len={self.max_len}")
        _positive(self, ("cell_size", "train_tensor", "train_expert", "serve_tensor", "serve_expert", "max_slots",
                         "max_len", "tokens_per_call", "page_size"))
        _positive(self, ("switch_retries", "kv_pages"), allow_zero=True)
        _positive(self, ("start_timeout_s",))
        if self.kv_cache not in ("contiguous", "paged"):
            raise ConfigError(f"config.cells.kv_cache must be 'contiguous' or 'paged', got {self.kv_cache!r}")
        if self.kv_cache == "paged" and self.max_len % self.page_size:
            raise ConfigError(f"config.cells.max_len={self.max_len} must be a multiple of cells.page_size="
                              f"{self.page_size} when cells.kv_cache='paged'")
        for name in ("train_tensor", "serve_tensor"):
            if self.cell_size % getattr(self, name):
                raise ConfigError(f"config.cells.{name}={getattr(self, name)} must divide cells.cell_size={self.cell_size}")
        if self.cell_size % (self.train_tensor * self.train_expert):
            raise ConfigError(f"config.cells.train_tensor * train_expert={self.train_tensor * self.train_expert} must "
                              f"divide cells.cell_size={self.cell_size}")
        if self.cell_size % (self.serve_tensor * self.serve_expert):
            raise ConfigError(f"config.cells.serve_tensor * serve_expert={self.serve_tensor * self.serve_expert} must "
                              f"divide cells.cell_size={self.cell_size}")


@dataclasses.dataclass(frozen=True, kw_only=True)
class SchedulerConfig:
    SECTION: ClassVar[str] = "scheduler"
    mode: str = ELASTIC  # one of MODES (the scheduler's policy modes)
    groups_per_step: int = 8  # G: groups trained per optimizer step
    group_size: int = 8  # rollouts per group (advantage baseline)
    staleness_bound: int = 1  # S: admission bound, in optimizer updates
    # k: optimizer updates per weight publication. 1 = one-step mode (one update per
    # publication; the streaming modes train each group as it is taken, the batch modes
    # pack and globally shuffle the whole step); k >= 2 = multi-step mode (rows stream into
    # the running step as groups finish, k updates train on rollouts of the last published version).
    updates_per_publication: int = 1
    async_train_cells: int = 1  # async modes: cells 0..k-1 train (k >= 1)
    # Priors until the controller has measured them (switch round trip; calls per running
    # agent): the policy's own defaults, so the loop runs the controller the simulator predicts
    # (gyre_jax/scheduler/policy.py says where each value comes from).
    min_work_per_switch_s: float = DEFAULT_MIN_WORK_PER_SWITCH_S
    serve_reserve: float = DEFAULT_SERVE_RESERVE
    # A JSON of measured costs (policy.Measured's fields), e.g. a pilot run's
    # <workdir>/<mode>/scheduler_costs.json: the policy's priors (PolicyConfig.priors). "" = none.
    priors: str = ""
    poll_s: float = 0.05  # controller tick period (it also wakes on every event)

    def __post_init__(self):
        if self.mode not in mode_names():
            raise ConfigError(f"config.scheduler.mode={self.mode!r}; known: {mode_names()}")
        _ints(self, ("groups_per_step", "group_size", "staleness_bound", "updates_per_publication", "async_train_cells"))
        _positive(self, ("groups_per_step", "group_size", "updates_per_publication", "async_train_cells",
                         "serve_reserve", "poll_s"))
        _positive(self, ("staleness_bound", "min_work_per_switch_s"), allow_zero=True)

    @property
    def multi_step(self) -> bool:
        return self.updates_per_publication > 1

    @property
    def stream_groups(self) -> bool:
        """Groups are packed and trained as they are taken (the streaming modes, as the
        simulator models them, and multi-step), not once the step's batch is whole."""
        return self.multi_step or get_mode(self.mode).streams


TASK_CHECKS = ("start", "off")


@dataclasses.dataclass(frozen=True, kw_only=True)
class TaskConfig:
    SECTION: ClassVar[str] = "task"
    family: str = "tiny"  # gyre_jax.agents.tasks family
    ops: str = "copy"  # tiny family: comma-separated ops (e.g. "copy,upper,reverse")
    min_len: int = 3
    max_len: int = 3
    run_tests_scale: float = 1.0  # tiny_tests, tiny_agent: x each task's test-suite seconds (1-30 s at 1)
    # tiny_agent: the fraction of the warm start's demonstrations that test their answer (RL's headroom)
    demo_test_fraction: float = 0.3
    # A JSONL task file (gyre_jax.agents.tasks.dataset); set, it replaces `family`. eval_dataset: a
    # second file of held-out tasks (besides the first file's split=eval lines).
    dataset: str = ""
    eval_dataset: str = ""
    # The task set's format and options, JSON text (gyre_jax.agents.tasks.formats): the format is read from the
    # path (gyre JSONL, SWE-bench-style JSONL, a directory of Harbor tasks) or named ("format"); e.g.
    # '{"environment": "host"}' runs Harbor or SWE-bench tasks on this host's toolchain (no per-task image).
    dataset_options: str = ""
    # Check every task's grader at start (gyre_jax.rl.task_gate; --check_tasks prints the same): "start"
    # (task files; a generated family's graders are gyre's own) or "off". A broken task stops the run
    # with one error: line, unless skip_broken drops it (counted in the log and summary).
    check: str = "start"
    skip_broken: bool = False
    # Host paths every graded command sees read-only besides the run's Python (comma-separated),
    # e.g. a toolchain its tests need (gyre_jax.agents.grader_sandbox).
    grader_ro_paths: str = ""

    def __post_init__(self):
        _positive(self, ("min_len", "max_len"))
        if self.check not in TASK_CHECKS:
            raise ConfigError(f"config.task.check must be one of {TASK_CHECKS}, got {self.check!r}")
        for p in self.grader_ro_path_list:
            if not os.path.isabs(p):
                raise ConfigError(f"config.task.grader_ro_paths: {p!r} is not an absolute path")
        _positive(self, ("run_tests_scale",), allow_zero=True)
        if not 0.0 <= self.demo_test_fraction <= 1.0:
            raise ConfigError(f"config.task.demo_test_fraction must be in [0, 1], got {self.demo_test_fraction!r}")
        if not self.ops_tuple:
            raise ConfigError("config.task.ops must name at least one op")
        if self.eval_dataset and not self.dataset:
            raise ConfigError("config.task.eval_dataset needs config.task.dataset (the training tasks' file)")
        if self.dataset_options:
            from gyre_jax.agents.tasks.formats import parse_options  # light: no format is read here

            try:
                parse_options(self.dataset_options)
            except ValueError as e:
                raise ConfigError(str(e)) from None

    @property
    def grader_ro_path_list(self) -> tuple[str, ...]:
        return tuple(p.strip() for p in self.grader_ro_paths.split(",") if p.strip())

    @property
    def ops_tuple(self) -> tuple[str, ...]:
        return tuple(o.strip() for o in self.ops.split(",") if o.strip())

    def kwargs(self) -> dict:
        """The family's ``make_task`` options: this section's fields named as its keyword parameters
        (``ops`` as a tuple), so a family with a new option needs only a field here of that name."""
        import inspect

        from gyre_jax.agents.tasks import family  # light: the family module alone

        make = getattr(family(self.family), "make_task", None)  # "dataset": its tasks come from a file
        params = inspect.signature(make).parameters if make is not None else {}
        values = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)} | {"ops": self.ops_tuple}
        return {k: v for k, v in values.items() if k in params and k != "seed"}

    def source(self, seed: int):
        """The run's TaskSource (gyre_jax.agents.task_sources): the task file's, else the family's."""
        from gyre_jax.agents.task_sources import make_source  # light: families load on first use

        if self.dataset:
            return make_source("dataset", path=self.dataset, eval_path=self.eval_dataset, seed=seed,
                               options=self.dataset_options)
        return make_source("family", family=self.family, seed=seed, kwargs=self.kwargs())


@dataclasses.dataclass(frozen=True, kw_only=True)
class HarnessKnobs:
    SECTION: ClassVar[str] = "harness"
    max_tokens: int = 88  # per model call
    temperature: float = 1.0
    max_turns: int = 1  # model calls per agent
    deadline_s: float = 60.0  # per rollout (a task without its own timeout_s)
    deadline_scale: float = 1.0  # a task's own timeout_s times this (a slow host: > 1)
    request_timeout_s: float = 60.0
    max_retries: int = 2
    backoff_base_s: float = 0.05
    grader_timeout_s: float = 30.0
    system_prompt: str = "Write the answer to answer.txt."  # replaces the task's when non-empty (shorter contexts)
    # Compaction and sub-agents (gyre_jax.agents.agent). context_budget_tokens: the next prompt's
    # estimated tokens above which the agent compacts (0 = the engine's max_len); "" = the defaults.
    context_budget_tokens: int = 0
    summary_request: str = ""
    summary_header: str = ""
    subagent_system_prompt: str = ""
    max_subagents: int = 4  # per rollout
    # True: the harness sends tool schemas and reads the API's tool_calls (a chat model's own tool-call
    # syntax, parsed by the proxy); False: text-format calls in the reply's content (the byte-level demo).
    send_tools_schema: bool = False
    # Where the policy's commands run (gyre_jax.agents.sandbox): auto = bubblewrap where it works;
    # where it cannot and the harness runs commands, the run refuses to start (fail closed) unless
    # `none` is chosen explicitly; bubblewrap, docker, podman, none.
    sandbox: str = "auto"
    # What runs an episode (gyre_jax.agents.harnesses): builtin (the example agent), python
    # (`entry`: module:function), command (`command`: a shell command run inside the sandbox).
    kind: str = "builtin"
    entry: str = ""  # kind=python: "module:function", called as `await function(task, client)`
    # kind=command: e.g. "mini -y --exit-immediately -t \"$(cat {instruction_file})\"" ({instruction_file},
    # {workspace}, {task_id} are replaced, shell-quoted); OPENAI_/ANTHROPIC_BASE_URL and _API_KEY are set.
    command: str = ""
    env: Mapping[str, str] = dataclasses.field(default_factory=dict)  # kind=command: extra environment
    ro_paths: str = ""  # kind=command: comma-separated host paths it sees read-only (default: this Python's)
    nonzero_exit: str = "infra_error"  # kind=command: infra_error | graded (its non-zero exit means "gave up")
    output_bytes: int = 16384  # kind=command: bytes of its output kept from the start, and from the end
    cpu_s: int = 3600  # kind=command: CPU seconds per process of the harness
    memory_bytes: int = 8 << 30  # kind=command: address space per process (node needs several GiB)

    def __post_init__(self):
        _positive(self, ("max_tokens", "max_turns", "deadline_s", "deadline_scale", "request_timeout_s",
                         "grader_timeout_s", "output_bytes", "cpu_s", "memory_bytes"))
        _positive(self, ("temperature", "max_retries", "backoff_base_s", "context_budget_tokens", "max_subagents"),
                  allow_zero=True)
        from gyre_jax.agents.sandbox import KINDS  # light: the sandbox module imports no JAX

        if self.sandbox not in KINDS:  # SandboxConfig would name its `kind`, another harness knob
            raise ConfigError(f"config.harness.sandbox must be one of {KINDS}, got {self.sandbox!r}")
        object.__setattr__(self, "env", dict(self.env))

    def make(self, unix_socket: str | None = None):
        """The harness object (gyre_jax.agents.harnesses); ``unix_socket``: the proxy's, for kind=command."""
        from gyre_jax.agents.harnesses import make_harness

        return make_harness(self.kind, entry=self.entry, command=self.command, env=self.env,
                            ro_paths=tuple(p.strip() for p in self.ro_paths.split(",") if p.strip()),
                            nonzero_exit=self.nonzero_exit, output_bytes=self.output_bytes, cpu_s=self.cpu_s,
                            memory_bytes=self.memory_bytes, unix_socket=unix_socket)


LORA_SERVING = ("auto", "merged", "unmerged")


@dataclasses.dataclass(frozen=True, kw_only=True)
class LoraKnobs:
    """config.train.lora: LoRA adapters instead of full fine-tuning (gyre_jax/model/lora.py).

    rank > 0 turns it on: the base is frozen (held in the serving dtype, no gradient, no optimizer
    state), and the optimizer, the checkpoints, every role switch and every weight publication hold
    and move the adapters only."""

    SECTION: ClassVar[str] = "train.lora"
    rank: int = 0  # 0 = full fine-tuning; r > 0: adapters of rank r on the targets, the base frozen
    alpha: float = 32.0  # the update is (alpha / rank) x A @ B (alpha / sqrt(rank) with rslora)
    dropout: float = 0.0  # on the adapters' inputs, training only
    # comma-separated PEFT module names (q_proj, k_proj, v_proj, o_proj, gate_proj, up_proj, down_proj;
    # on MoE layers the last three adapt every expert), or "all"
    targets: str = "all"
    layers: str = ""  # comma-separated layer indices or ranges ("0-11,20"); "" = every layer
    rslora: bool = False
    # merged: each engine serves the base with the adapter folded in (exact, no per-token cost; the
    # cell keeps the base to merge each new version into); unmerged: the engine applies the adapter
    # per token beside the base weights (what several adapters need); auto: merged for one adapter
    serve: str = "auto"
    init_from: str = ""  # a PEFT adapter directory (adapter_config.json + adapter_model.safetensors) to continue
    # Multi-LoRA: this many adapters over the one base, each its own task set and optimizer state; group g
    # trains adapter g % adapters, and the proxy routes its rollouts' calls to that adapter by their key.
    adapters: int = 1
    # Each adapter's task set: "|"-separated, per adapter ";"-separated overrides of config.task's fields,
    # e.g. "ops=copy|ops=upper"; "" = every adapter draws from config.task (its own stream of it).
    adapter_tasks: str = ""

    def __post_init__(self):
        _ints(self, ("rank", "adapters"))
        _positive(self, ("rank", "dropout"), allow_zero=True)
        _positive(self, ("adapters",))
        if self.serve not in LORA_SERVING:
            raise ConfigError(f"config.train.lora.serve must be one of {LORA_SERVING}, got {self.serve!r}")
        if self.adapters > 1 and self.serve == "merged":
            raise ConfigError(f"config.train.lora.adapters={self.adapters}: serve='merged' folds one adapter into the "
                              "weights; several serve 'unmerged' (or 'auto')")
        if (self.adapters > 1 or self.adapter_tasks) and not self.rank:
            raise ConfigError("config.train.lora.adapters / adapter_tasks need config.train.lora.rank > 0")
        if self.adapter_tasks and len(self.adapter_tasks.split("|")) != self.adapters:
            raise ConfigError(f"config.train.lora.adapter_tasks={self.adapter_tasks!r} names "
                              f"{len(self.adapter_tasks.split('|'))} task sets for adapters={self.adapters}")
        if self.rank:
            self.lora_config()  # every field checked now, before any JAX work

    @property
    def serving(self) -> str:
        """How engines serve the adapters: merged for one adapter, unmerged for several (serve='auto')."""
        if self.serve != "auto":
            return self.serve
        return "merged" if self.adapters == 1 else "unmerged"

    def task_overrides(self) -> list[dict[str, str]]:
        """Each adapter's overrides of config.task (raw strings; RLConfig types them)."""
        if not self.adapter_tasks:
            return [{} for _ in range(self.adapters)]
        out = []
        for a, part in enumerate(self.adapter_tasks.split("|")):
            fields = {}
            for item in (x.strip() for x in part.split(";") if x.strip()):
                k, eq, v = item.partition("=")
                if not eq:
                    raise ConfigError(f"config.train.lora.adapter_tasks: adapter {a}'s {item!r} is not field=value")
                fields[k.strip()] = v.strip()
            out.append(fields)
        return out

    @property
    def enabled(self) -> bool:
        return self.rank > 0

    def lora_config(self):
        """The model's LoraConfig (None when rank is 0)."""
        if not self.rank:
            return None
        from gyre_jax.model.lora import TARGETS, LoraConfig

        targets = TARGETS if self.targets.strip() in ("all", "") else tuple(
            t.strip() for t in self.targets.split(",") if t.strip())
        return _built("train.lora", lambda: LoraConfig(rank=self.rank, alpha=self.alpha, dropout=self.dropout,
                                                       targets=targets, layers=_layer_list(self.layers),
                                                       rslora=self.rslora, num_adapters=self.adapters))


def _layer_list(text: str) -> tuple[int, ...]:
    """"0-3,7" -> (0, 1, 2, 3, 7); ConfigError naming config.train.lora.layers otherwise."""
    out: list[int] = []
    for part in (p.strip() for p in text.split(",") if p.strip()):
        lo, sep, hi = part.partition("-")
        try:
            out += list(range(int(lo), int(hi) + 1)) if sep else [int(lo)]
        except ValueError:
            raise ConfigError(f"config.train.lora.layers={text!r}: {part!r} is not a layer index or a range "
                              "like 0-11") from None
    return tuple(out)


@dataclasses.dataclass(frozen=True, kw_only=True)
class TrainConfig:
    """The optimizer, the objective and the rows it trains on.

    The objective is four names, one per registry of ``gyre_jax.losses`` (the README lists
    every entry with its paper): ``loss`` (policy loss), ``advantage`` (estimator),
    ``weights`` (aggregation) and ``mismatch`` (train-inference correction, or "off").
    Their options are flat fields named as the entries' config fields (``Registry.options``;
    tests/test_config_schema.py checks each has its field here); None means the chosen entry's
    own default, and an option the chosen entry does not take is a config error naming it.
    """

    SECTION: ClassVar[str] = "train"
    row_len: int = 160  # packed row length L
    micro_batch_rows: int = 2  # rows per micro-batch (one compiled shape)
    learning_rate: float = 1e-4
    warmup_steps: int = 0
    weight_decay: float = 0.0
    max_grad_norm: float = 1.0
    adam_b2: float = 0.999
    adam_eps: float = 1e-8  # larger values damp Adam's full-size steps on rarely-seen tokens' rows
    loss: str = "ppo_clip"  # gyre_jax.losses.POLICY_LOSSES
    advantage: str = "grpo"  # gyre_jax.losses.ADVANTAGE_ESTIMATORS
    weights: str = "rollout_token_mean"  # gyre_jax.losses.WEIGHT_BUILDERS
    mismatch: str = "off"  # gyre_jax.losses.MISMATCH_CORRECTIONS, or "off"
    eps_low: float | None = None  # clip range (ppo_clip, gspo, decoupled_ppo; cispo's IS-weight bounds)
    eps_high: float | None = None
    clip_c: float | None = None  # dual clip (ppo_clip, decoupled_ppo): the A < 0 loss at most -c*A (c > 1; 0 = off)
    behavior_cap: float | None = None  # decoupled_ppo: drop tokens with pi_prox / pi_behav above it
    is_cap: float | None = None  # reinforce: truncate the IS weight at it
    mismatch_cap: float | None = None  # tis, tis_seq: w = min(rho, cap)
    mismatch_low: float | None = None  # mis, mis_seq, icepop: keep rho in [low, high]
    mismatch_high: float | None = None
    kl_coef: float = 0.0  # KL to the reference (the warm start), computed on the step's rows
    kl_estimator: str = "k3"  # k1 | k2 | k3
    entropy_coef: float = 0.0  # entropy bonus (the entropy is reported either way)
    # Loss safety (gyre_jax.losses.policy_gradient): log-ratios are clamped to +-this before
    # exp, so loss and gradient stay finite whatever engine and trainer disagree by.
    log_ratio_clamp: float = 20.0
    advantage_eps: float | None = None  # grpo / reinforce_pp*: added to the std
    # Multiplies negative advantages (trajectory.rewards.AdvantageConfig.negative_advantage_scale):
    # 1.0 = as the estimator gives them, 0.0 = reinforce only better-than-baseline rollouts.
    negative_advantage_scale: float = 1.0
    weights_normalizer: int | None = None  # weights=constant: C tokens (None: row_len)
    # DAPO dynamic sampling: drop groups whose rewards are all equal, launch replacements;
    # at most dynamic_sampling_budget x groups_per_step x steps groups over the run.
    dynamic_sampling: bool = False
    dynamic_sampling_budget: float = 1.0
    # DAPO overlong shaping of a rollout's reward by its generated tokens (0 = off).
    overlong_max_tokens: int = 0
    overlong_buffer_tokens: int = 0
    overlong_penalty: float = 1.0
    work_s_per_row: float = 0.05  # initial estimate of training cell-seconds per row (then measured)
    # MoE models: the training forward uses the experts the engine recorded for each sampled token
    # (rollout routing replay, R3; gyre_jax/model/moe.py) instead of re-routing it live. Either way
    # the step reports routing_mismatch, the fraction of trained tokens whose live routing differs.
    routing_replay: bool = False
    # LoRA instead of full fine-tuning (LoraKnobs): --config.train.lora.rank=16 on any RL config
    lora: LoraKnobs = LoraKnobs()

    def __post_init__(self):
        if isinstance(self.lora, Mapping):
            object.__setattr__(self, "lora", _build(LoraKnobs, self.lora, "train.lora"))
        elif not isinstance(self.lora, LoraKnobs):
            raise ConfigError(f"config.train.lora must be a section of {sorted(f.name for f in dataclasses.fields(LoraKnobs))}, "
                              f"got {self.lora!r}")
        _positive(self, ("row_len", "micro_batch_rows", "learning_rate", "max_grad_norm", "work_s_per_row", "adam_eps"))
        if not isinstance(self.routing_replay, bool):
            raise ConfigError(f"config.train.routing_replay must be True or False, got {self.routing_replay!r}")
        from gyre_jax.losses import ADVANTAGE_ESTIMATORS, MISMATCH_CORRECTIONS, MISMATCH_OFF, POLICY_LOSSES, \
            WEIGHT_BUILDERS

        for name, reg, extra in (("loss", POLICY_LOSSES, ()), ("advantage", ADVANTAGE_ESTIMATORS, ()),
                                 ("weights", WEIGHT_BUILDERS, ()), ("mismatch", MISMATCH_CORRECTIONS, (MISMATCH_OFF,))):
            v = getattr(self, name)
            if v not in reg and v not in extra:
                raise ConfigError(f"config.train.{name}={v!r}; known: {list(extra) + reg.names()}")
        if not isinstance(self.dynamic_sampling, bool):
            raise ConfigError(f"config.train.dynamic_sampling must be True or False, got {self.dynamic_sampling!r}")
        _positive(self, ("dynamic_sampling_budget",), allow_zero=True)
        _ints(self, ("overlong_max_tokens", "overlong_buffer_tokens"))

    @property
    def scope(self) -> str:
        """``group`` or ``step``: what the advantage estimator needs before a group can train."""
        from gyre_jax.losses import ADVANTAGE_ESTIMATORS

        return ADVANTAGE_ESTIMATORS.get(self.advantage).scope


def train_objective_fields() -> dict:
    """The objective's fields for a config file's ``c.train`` dict, at TrainConfig's defaults.

    Fields whose default is "the chosen entry's own" are typed placeholders, so
    ``--config.train.eps_low=3e-4`` parses as a float though the value is None.
    """
    from ml_collections import config_dict

    names = ("loss", "advantage", "weights", "mismatch", "kl_coef", "kl_estimator", "entropy_coef", "log_ratio_clamp",
             "negative_advantage_scale", "dynamic_sampling", "dynamic_sampling_budget", "overlong_max_tokens",
             "overlong_buffer_tokens", "overlong_penalty") + entry_options()
    out = {}
    for f in dataclasses.fields(TrainConfig):
        if f.name in names:
            if f.default is None:
                out[f.name] = config_dict.placeholder(int if str(f.type).startswith("int") else float)
            else:
                out[f.name] = f.default
    return out


def entry_options() -> tuple[str, ...]:
    """The TrainConfig fields that are options of a registered loss, correction, estimator or weight builder."""
    from gyre_jax.losses import ADVANTAGE_ESTIMATORS, MISMATCH_CORRECTIONS, POLICY_LOSSES, WEIGHT_BUILDERS

    return tuple(o for r in (POLICY_LOSSES, MISMATCH_CORRECTIONS, ADVANTAGE_ESTIMATORS, WEIGHT_BUILDERS)
                 for o in r.options())


def _entry_config(registry, name: str, t: TrainConfig, defaults: Mapping[str, Any] | None = None):
    """The chosen entry's config from the TrainConfig fields of its fields' names (None: ``defaults``'s
    value, else the entry's own); another entry's option set here is a ConfigError naming it."""
    entry = registry.get(name)
    own = {f.name for f in dataclasses.fields(entry.config)}
    for k in registry.options():
        if k not in own and getattr(t, k) is not None:
            raise ConfigError(f"config.train.{k} does not apply to {registry.flag.split('.')[-1]}={name!r}")
    values = {k: v for k, v in (defaults or {}).items() if k in own}
    values.update({k: getattr(t, k) for k in own if getattr(t, k) is not None})
    return _built("train", lambda: entry.make_config(values))


NOISE_KINDS = ("reverse", "one_char", "random", "give_up")  # gyre_jax.rl.sft.noisy_tasks


@dataclasses.dataclass(frozen=True, kw_only=True)
class SFTConfig:
    SECTION: ClassVar[str] = "sft"
    steps: int = 600  # supervised steps on scripted demonstrations (0: no warm start)
    rows: int = 6  # packed rows per step
    learning_rate: float = 1e-3
    demos: int = 512  # distinct demonstration tasks (cycled)
    # Fraction of demonstrations that are deliberately bad (a wrong answer, or giving up;
    # 'tiny' family only, see gyre_jax.rl.sft.noisy_tasks). 0 = clean.
    # > 0 is meant to leave the warm-started policy right only part of the time (headroom
    # and reward variance for RL); measured results in docs/results.md.
    noisy_fraction: float = 0.0
    noisy_kind: str = "reverse"  # how a demonstration is bad: reverse | one_char | random | give_up
    # A directory of warm starts keyed by what determines them (gyre_jax.rl.warm_cache): runs that
    # differ only in RL knobs (mode, loss, steps) train the warm start once. "" = off.
    cache_dir: str = ""
    # The warm start's seed (init and demonstration order); -1 = config.seed. Set, runs that differ
    # only in config.seed share one warm start: a spread over RL seeds from the same starting point.
    seed: int = -1

    def __post_init__(self):
        _positive(self, ("steps", "demos"), allow_zero=True)
        _positive(self, ("rows", "learning_rate"))
        if isinstance(self.seed, bool) or not isinstance(self.seed, int) or self.seed < -1:
            raise ConfigError(f"config.sft.seed must be an int >= -1 (-1 = config.seed), got {self.seed!r}")
        if not 0.0 <= self.noisy_fraction < 1.0:
            raise ConfigError(f"config.sft.noisy_fraction must be in [0, 1), got {self.noisy_fraction!r}")
        if self.noisy_kind not in NOISE_KINDS:
            raise ConfigError(f"config.sft.noisy_kind={self.noisy_kind!r}; known: {NOISE_KINDS}")


@dataclasses.dataclass(frozen=True, kw_only=True)
class EvalConfig:
    """Held-out eval of fixed tasks at a fixed policy version and fixed sampling seeds.

    kind=episodes (gyre_jax.rl.episode_eval): whole episodes through the run's own harness on a
    dedicated engine; mean score, pass@1, pass@k. kind=first_call (gyre_jax.rl.evaluate): a fast
    extra for one-call families: the built-in agent's FIRST model call only, in-process."""

    SECTION: ClassVar[str] = "eval"
    every: int = 10  # evaluate after every k-th step (and before the first, after the last); 0 = off
    kind: str = "first_call"  # episodes | first_call
    tasks: int = 32  # held-out tasks (a family's seeds 2**29 + s; a task file's split=eval lines)
    samples_per_task: int = 8  # k of pass@k
    temperature: float = 1.0  # 0 = greedy; default = the harness's rollout temperature
    pass_score: float = 1.0  # an episode scoring at least this counts as passed (pass@k)
    # kind=episodes: each episode's deadline is harness.deadline_s (or its task's timeout_s x harness.deadline_scale)
    # times this. An eval scores the policy;
    # the run's own rollouts and training load the machine beside it, and an episode that misses the
    # rollouts' deadline for that reason must not score as the policy's timeout (eval_timeouts still counts).
    deadline_scale: float = 4.0

    def __post_init__(self):
        _positive(self, ("every",), allow_zero=True)
        _positive(self, ("tasks", "samples_per_task", "deadline_scale"))
        _positive(self, ("temperature",), allow_zero=True)
        if self.kind not in ("episodes", "first_call"):
            raise ConfigError(f"config.eval.kind={self.kind!r}; known: ('episodes', 'first_call')")
        if not 0.0 < self.pass_score <= 1.0:
            raise ConfigError(f"config.eval.pass_score must be in (0, 1], got {self.pass_score!r}")


@dataclasses.dataclass(frozen=True, kw_only=True)
class MetricsConfig:
    """Where per-step metrics go besides metrics.jsonl and TensorBoard (gyre_jax.rl.metrics)."""

    SECTION: ClassVar[str] = "metrics"
    wandb: str = "off"  # off | offline (files under <workdir>/<mode>/wandb; `wandb sync` them later) | online
    wandb_project: str = "gyre_jax"

    def __post_init__(self):
        from gyre_jax.rl.metrics import WANDB_MODES

        if self.wandb not in WANDB_MODES:
            raise ConfigError(f"config.metrics.wandb={self.wandb!r}; known: {WANDB_MODES}")
        if self.wandb != "off" and importlib.util.find_spec("wandb") is None:  # say so before any work
            raise ConfigError(f"config.metrics.wandb={self.wandb} needs the wandb package: pip install -e '.[wandb]'")


@dataclasses.dataclass(frozen=True, kw_only=True)
class FaultConfig:
    """Injected faults (gyre_jax.rl.faults); 0 = off. Every k-th rollout launched (1-based) gets it."""

    SECTION: ClassVar[str] = "faults"
    grader_crash_every: int = 0  # its grader raises -> verifier_error
    timeout_every: int = 0  # its calls stall past the deadline -> timeout, graded for partial credit
    engine_error_every: int = 0  # its first model call fails in the engine -> 500, the harness retries
    # Not a rollout fault: the trainer prints "PAUSED <step>" once that step (0-based, so
    # step 0 cannot be paused) has started on the cells and blocks before its update is
    # kept or checkpointed, so a test can kill -9 the run mid-step (tests/test_rl_resume.py).
    pause_at_step: int = 0
    # Chaos in the cells' timing (the loop's stress test): each role switch, step join
    # and leave waits a random time in [0, switch_delay_s) at a random point.
    switch_delay_s: float = 0.0
    switch_fail_every: int = 0  # every k-th switch attempt raises once (transient: it is retried)
    satellite_fail_every: int = 0  # every k-th micro-batch a satellite pulls fails it (work handed back)
    chaos_seed: int = 0  # seeds the random delays
    # Not survivable: the core fails when step k starts (k >= 1), so the run saves what it can
    # and stops with RunFailed; rerunning without it resumes (the failure path's test).
    core_fail_at_step: int = 0

    def __post_init__(self):
        _ints(self, ("grader_crash_every", "timeout_every", "engine_error_every", "pause_at_step",
                     "switch_fail_every", "satellite_fail_every", "chaos_seed", "core_fail_at_step"))
        _positive(self, ("grader_crash_every", "timeout_every", "engine_error_every", "pause_at_step",
                         "switch_delay_s", "switch_fail_every", "satellite_fail_every", "chaos_seed",
                         "core_fail_at_step"), allow_zero=True)

    @property
    def any(self) -> bool:
        """Whether rollouts are marked and backends wrapped (RLFaults); the pause needs neither."""
        return bool(self.grader_crash_every or self.timeout_every or self.engine_error_every)

    @property
    def chaos(self) -> bool:
        """Whether the cells' switches and steps get random delays or failures."""
        return bool(self.switch_delay_s or self.switch_fail_every or self.satellite_fail_every
                    or self.core_fail_at_step)


@dataclasses.dataclass(frozen=True, kw_only=True)
class RLConfig:
    SECTION: ClassVar[str] = "config"
    seed: int = 0
    steps: int = 60  # optimizer steps (N)
    num_cpu_devices: int = 8  # host devices when running on CPU (set before JAX starts)
    first_last: int = 10  # steps averaged for the "reward first vs last" line
    checkpoint_every: int = 10  # save every k steps (0 = only at the end)
    progress: bool = True  # a bar on a terminal, one line per step otherwise
    progress_every_s: float = 60.0  # off a terminal: a line at least this often while a step runs
    model: ModelConfig
    # config.model.hf_path: a Hugging Face checkpoint directory (config.json, safetensors, tokenizer.json,
    # tokenizer_config.json with its chat template). Set, the model's shape comes from its config.json, the
    # params from its weights and the proxy speaks its chat template and tool-call syntax.
    hf_path: str = ""
    hf_export: bool = False  # config.model.hf_export: save_pretrained into <workdir>/hf_export after the last step
    # config.model.chat_template_kwargs: variables for the checkpoint's chat template in every render (the proxy's
    # prompts, SFT), as JSON text, e.g. '{"enable_thinking": false}' for Qwen3's non-thinking mode; a request's
    # own chat_template_kwargs go over them. Needs hf_path (the byte tokenizer's template has no variables).
    chat_template_kwargs: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    cells: CellsConfig = CellsConfig()
    scheduler: SchedulerConfig = SchedulerConfig()
    task: TaskConfig = TaskConfig()
    harness: HarnessKnobs = HarnessKnobs()
    train: TrainConfig = TrainConfig()
    sft: SFTConfig = SFTConfig()
    eval: EvalConfig = EvalConfig()
    faults: FaultConfig = FaultConfig()
    metrics: MetricsConfig = MetricsConfig()

    def __post_init__(self):
        for n in ("steps", "num_cpu_devices", "first_last", "progress_every_s"):
            v = getattr(self, n)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not v > 0:
                raise ConfigError(f"config.{n} must be > 0, got {v!r}")
        if self.chat_template_kwargs and not self.hf_path:
            raise ConfigError(f"config.model.chat_template_kwargs={dict(self.chat_template_kwargs)} needs "
                              "config.model.hf_path (the byte tokenizer's chat template takes no variables)")
        if isinstance(self.checkpoint_every, bool) or not isinstance(self.checkpoint_every, int) or self.checkpoint_every < 0:
            raise ConfigError(f"config.checkpoint_every must be an int >= 0, got {self.checkpoint_every!r}")
        if self.train.row_len > self.model.max_seq_len:
            raise ConfigError(f"config.train.row_len={self.train.row_len} > model.max_seq_len={self.model.max_seq_len}")
        if self.cells.max_len > self.model.max_seq_len:
            raise ConfigError(f"config.cells.max_len={self.cells.max_len} > model.max_seq_len={self.model.max_seq_len}")
        if self.train.routing_replay and self.model.num_experts == 0:
            raise ConfigError("config.train.routing_replay=True needs a mixture-of-experts model (model.num_experts > 0); "
                              "this model is dense: nothing is routed")
        for knob in ("train_expert", "serve_expert"):  # the experts split evenly over the 'expert' axis, or not at all
            degree = getattr(self.cells, knob)
            if degree > 1 and self.model.num_experts == 0:
                raise ConfigError(f"config.cells.{knob}={degree} splits a mixture-of-experts model's experts; this "
                                  "model is dense (model.num_experts=0): set it to 1")
            if degree > 1 and self.model.num_experts % degree:
                raise ConfigError(f"config.cells.{knob}={degree}: model.num_experts={self.model.num_experts} does not "
                                  "split evenly over it")
        fsdp = self.cells.cell_size // self.cells.train_tensor
        if self.train.micro_batch_rows % fsdp:
            raise ConfigError(f"config.train.micro_batch_rows={self.train.micro_batch_rows} must be a multiple of the "
                              f"cells' fsdp size cells.cell_size/cells.train_tensor={fsdp} (rows are split over it)")
        if self.harness.max_tokens >= self.cells.max_len:
            raise ConfigError(f"config.harness.max_tokens={self.harness.max_tokens} must be < cells.max_len="
                              f"{self.cells.max_len}")
        self._check_lora()
        # Build (and throw away) everything the loop builds later from these values. The
        # cell layout is checked against the devices (check_devices) as soon as JAX is up.
        self.policy_config()
        self.processor_config()
        self.loss_config()
        self.optimizer_config()
        self.cell_config()
        self.harness_config("http://127.0.0.1:1/v1")
        harness = _built("harness", lambda: self.harness.make("/nonexistent.sock"))
        source = self.task_source
        first = _built("task", lambda: source.train_task(0))
        if self.sft.noisy_fraction and self.task.family != "tiny":
            raise ConfigError(f"config.sft.noisy_fraction={self.sft.noisy_fraction} needs task.family='tiny' "
                              f"(got {self.task.family!r})")
        if self.sft.steps:
            try:
                source.demo_tasks(1)
            except LookupError as e:
                raise ConfigError(f"config.sft.steps={self.sft.steps}: {e}") from None
        if self.eval.every and not source.eval_tasks(1):
            raise ConfigError(f"config.eval.every={self.eval.every}: {source.describe()} has no held-out tasks "
                              "(split=eval lines, or config.task.eval_dataset)")
        if self.eval.kind == "first_call" and self.harness.kind != "builtin":
            raise ConfigError("config.eval.kind='first_call' scores the built-in agent's first call only; with "
                              f"harness.kind={self.harness.kind!r} use eval.kind='episodes'")
        self._check_sandbox(harness.needs_commands(first))

    def _check_lora(self) -> None:
        """The adapters fit this model (layers, MoE, parallelism); each adapter's task set builds and has
        held-out tasks."""
        if self.train.lora.enabled:
            _built("train.lora", lambda: self.policy_model)
        if self.train.lora.adapters > 1:
            for src in self.adapter_sources:
                _built("train.lora.adapter_tasks", lambda: src.train_task(0))  # noqa: B023 - called at once
                if self.eval.every and not src.eval_tasks(1):
                    raise ConfigError(f"config.train.lora.adapter_tasks: {src.describe()} has no held-out tasks")
            if self.eval.every and self.eval.kind != "first_call":
                raise ConfigError("config.train.lora.adapters > 1: the held-out eval of each adapter on each task set is "
                                  "eval.kind='first_call' (whole-episode evals per adapter are not covered)")

    @functools.cached_property
    def task_source(self):
        """The run's TaskSource, built (and its file read) once."""
        return _built("task", lambda: self.task.source(self.seed))

    def _check_sandbox(self, runs_commands: bool) -> None:
        """Fail closed: a harness that runs the policy's commands needs a working sandbox, or
        harness.sandbox='none' chosen explicitly."""
        if not runs_commands or self.harness.sandbox != "auto":
            return
        from gyre_jax.agents.sandbox import bwrap_usable

        ok, why = bwrap_usable()
        if not ok:
            raise ConfigError(f"config.harness.sandbox='auto': {why}, and the policy's commands must not run on "
                              "this host unconfined. Install bubblewrap (apt-get install bubblewrap) or set "
                              "--config.harness.sandbox=none to run them on the host deliberately")

    @property
    def lora(self):
        """The run's LoraConfig (model/lora.py), None for full fine-tuning."""
        return self.train.lora.lora_config()

    @property
    def policy_model(self) -> ModelConfig:
        """The model the loop trains and scores: config.model, with LoRA adapters when config.train.lora.rank > 0."""
        lora = self.lora
        return self.model if lora is None else self.model.replace(lora=lora)

    @property
    def switch_move_bytes(self) -> int:
        """Bytes one role switch or publication moves: the params, or a LoRA run's adapters (float32)."""
        import math

        from gyre_jax import planner

        lora = self.lora
        if lora is None:
            return sum(math.prod(s) for _, s, _ in planner.param_table(self.model)) * planner.DTYPE_BYTES[
                self.model.param_dtype]
        return 4 * sum(math.prod(s) for _, s, _ in planner.lora_table(self.model, lora))

    # ---- the objects the loop builds from the config (validated here) ----
    @functools.cached_property
    def scheduler_priors(self):
        """config.scheduler.priors's costs (policy.Measured; NOT_MEASURED when unset), read once."""
        from gyre_jax.scheduler import costs_file, policy as policy_lib

        path = self.scheduler.priors
        if not path:
            return policy_lib.NOT_MEASURED
        try:
            return costs_file.load(path)
        except ValueError as e:
            raise ConfigError(f"config.scheduler.priors={path!r}: {e}") from None

    def policy_config(self, n_cells: int | None = None, own_costs=None):
        """The scheduler's PolicyConfig; with ``n_cells``, also checks the mode's layout fits.
        ``own_costs``: what this workdir's earlier attempt measured (a resumed run): its priors
        where it measured them, config.scheduler.priors's elsewhere."""
        from gyre_jax.scheduler import policy as policy_lib

        from gyre_jax.scheduler.costs import for_move_bytes

        s = self.scheduler
        # A pilot's (or a full-weights run's) switch costs, with the weight move rescaled to what this run's
        # switches move: a LoRA run's adapters, not the weights (scheduler/costs.py: for_move_bytes).
        priors = for_move_bytes(self.scheduler_priors, self.switch_move_bytes)
        priors = priors if own_costs is None else policy_lib.filled(own_costs, priors)
        pc = _built("scheduler", lambda: policy_lib.PolicyConfig(
            mode=s.mode, total_steps=self.steps, groups_per_step=s.groups_per_step, group_size=s.group_size,
            staleness_bound=s.staleness_bound, updates_per_publication=s.updates_per_publication,
            async_train_cells=s.async_train_cells if get_mode(s.mode).fixed_split else 0,
            serve_reserve=s.serve_reserve, min_work_per_switch_s=s.min_work_per_switch_s, priors=priors))
        if n_cells is not None and pc.strategy.fixed_split and not 1 <= s.async_train_cells < n_cells:
            raise ConfigError(f"config.scheduler.async_train_cells={s.async_train_cells} must be in [1, {n_cells - 1}]: "
                              f"{n_cells} cells of cells.cell_size={self.cells.cell_size} devices, one must serve")
        if n_cells is not None:
            _built("scheduler", lambda: policy_lib.initial_roles(pc, n_cells))
        return pc

    def check_devices(self, n_devices: int):
        """The cells this many devices make; ConfigError if the layout cannot run."""
        c = self.cells
        if n_devices % c.cell_size:
            raise ConfigError(f"config.cells.cell_size={c.cell_size} does not divide the {n_devices} devices")
        n_cells = n_devices // c.cell_size
        self.policy_config(n_cells)
        return n_cells

    def group_task(self, g: int):
        """The task of the run's g-th launched group (gyre_jax.agents.task_sources: disjoint from eval's and SFT's);
        with several LoRA adapters, the ``g // adapters``-th task of adapter ``g % adapters``'s task set."""
        n = self.train.lora.adapters
        if n == 1:
            return self.task_source.train_task(g)
        return self.adapter_sources[g % n].train_task(g // n)

    def group_adapter(self, g: int) -> int:
        """The LoRA adapter the run's g-th group trains (and whose rollouts the proxy serves with it)."""
        return g % self.train.lora.adapters

    @functools.cached_property
    def adapter_sources(self) -> list:
        """Each LoRA adapter's TaskSource: config.task with the adapter's overrides (train.lora.adapter_tasks)."""
        out = []
        types = {f.name: f.type for f in dataclasses.fields(TaskConfig)}
        for a, over in enumerate(self.train.lora.task_overrides()):
            bad = sorted(set(over) - set(types))
            if bad:
                raise unknown_fields(f"train.lora.adapter_tasks (adapter {a})", bad, types)
            typed: dict[str, Any] = {}
            for k, v in over.items():
                kind = str(types[k])
                try:
                    typed[k] = int(v) if kind == "int" else float(v) if kind == "float" else v
                except ValueError:
                    raise ConfigError(f"config.train.lora.adapter_tasks: adapter {a}'s {k}={v!r} is not a {kind}") from None
            task = _built("train.lora.adapter_tasks", lambda: dataclasses.replace(self.task, **typed))  # noqa: B023
            out.append(_built("task", lambda: task.source(self.seed + a)))  # noqa: B023 - called at once
        return out

    def processor_config(self):
        from gyre_jax.losses import ADVANTAGE_ESTIMATORS, WEIGHT_BUILDERS
        from gyre_jax.trajectory.processor import ProcessorConfig
        from gyre_jax.trajectory.rewards import AdvantageConfig

        t = self.train
        est = _entry_config(ADVANTAGE_ESTIMATORS, t.advantage, t)
        adv = _built("train", lambda: AdvantageConfig(
            estimator=t.advantage, estimator_config=est,
            negative_advantage_scale=t.negative_advantage_scale, overlong_max_tokens=t.overlong_max_tokens,
            overlong_buffer_tokens=t.overlong_buffer_tokens, overlong_penalty=t.overlong_penalty))
        # weights=constant's C defaults to the row length here (the entry's own 4096 suits long rollouts)
        wcfg = _entry_config(WEIGHT_BUILDERS, t.weights, t, {"weights_normalizer": t.row_len})
        return _built("train", lambda: ProcessorConfig(row_len=t.row_len, advantage=adv, weights=t.weights,
                                                       weights_config=wcfg, routing_width=self.model.routing_width))

    def loss_config(self):
        from gyre_jax.losses import PolicyLossConfig

        t = self.train
        from gyre_jax.losses import MISMATCH_CORRECTIONS, POLICY_LOSSES

        options = {k: getattr(t, k) for k in POLICY_LOSSES.options() + MISMATCH_CORRECTIONS.options()}
        return _built("train", lambda: PolicyLossConfig.create(
            loss=t.loss, mismatch=t.mismatch, kl_coef=t.kl_coef, kl_estimator=t.kl_estimator,
            entropy_coef=t.entropy_coef, log_ratio_clamp=t.log_ratio_clamp, **options))

    @property
    def stream_groups(self) -> bool:
        """Groups are packed and trained as they are taken (the scheduler's streaming modes and
        multi-step), unless the advantage estimator normalises over the whole step."""
        return self.scheduler.stream_groups and self.train.scope == "group"

    def dynamic_sampling_budget(self) -> int:
        """Groups DAPO's dynamic sampling may drop over the run (0: off)."""
        t = self.train
        return int(round(t.dynamic_sampling_budget * self.scheduler.groups_per_step * self.steps)) \
            if t.dynamic_sampling else 0

    def optimizer_config(self):
        from gyre_jax.cells.train_state import OptimizerConfig

        t = self.train
        return _built("train", lambda: OptimizerConfig(
            learning_rate=t.learning_rate, warmup_steps=t.warmup_steps, weight_decay=t.weight_decay,
            max_grad_norm=t.max_grad_norm, adam_b2=t.adam_b2, adam_eps=t.adam_eps))

    def cell_config(self):
        from gyre_jax.cells.mesh import CellConfig

        c = self.cells
        return _built("cells", lambda: CellConfig(cell_size=c.cell_size, train_tensor=c.train_tensor,
                                                  train_expert=c.train_expert, serve_tensor=c.serve_tensor,
                                                  serve_expert=c.serve_expert))

    @property
    def warm_seed(self) -> int:
        """The warm start's seed: config.sft.seed, or config.seed when that is -1."""
        return self.seed if self.sft.seed < 0 else self.sft.seed

    def harness_config(self, base_url: str, run_id: str = "rl"):
        from gyre_jax.agents.config import HarnessConfig
        from gyre_jax.agents.sandbox import SandboxConfig

        h = self.harness
        return _built("harness", lambda: HarnessConfig(
            base_url=base_url, run_id=run_id, max_tokens=h.max_tokens, temperature=h.temperature,
            send_tools_schema=h.send_tools_schema, bytes_per_token=1.0, max_turns=h.max_turns,
            context_budget_tokens=h.context_budget_tokens or self.cells.max_len, deadline_s=h.deadline_s,
            deadline_scale=h.deadline_scale,
            request_timeout_s=h.request_timeout_s, summary_request=h.summary_request or None,
            summary_header=h.summary_header or None, subagent_system_prompt=h.subagent_system_prompt or None,
            max_subagents=h.max_subagents,
            max_retries=h.max_retries, backoff_base_s=h.backoff_base_s, concurrency=self.scheduler.group_size,
            grader_timeout_s=h.grader_timeout_s, grader_concurrency=2, system_prompt=h.system_prompt or None,
            grader_ro_paths=self.task.grader_ro_path_list, sandbox=SandboxConfig(kind=h.sandbox)))

    @classmethod
    def from_config(cls, config: Any) -> "RLConfig":
        d = config.to_dict() if hasattr(config, "to_dict") else dict(config)
        d = {k: v for k, v in d.items() if k not in ("job", "workdir", "recoverable_processes")}  # launcher's keys
        nested = dict(model=ModelConfig, cells=CellsConfig, scheduler=SchedulerConfig, task=TaskConfig,
                      harness=HarnessKnobs, train=TrainConfig, sft=SFTConfig, eval=EvalConfig,
                      faults=FaultConfig, metrics=MetricsConfig)
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(d) - known)
        if unknown:
            raise unknown_fields("", unknown, known)
        if "model" not in d:
            raise ConfigError("config.model is required")
        model = dict(d["model"])
        hf_path, hf_export = model.pop("hf_path", "") or "", bool(model.pop("hf_export", False))
        model = drop_random_init_shape(model, hf_path)
        from gyre_jax.serving.tokenizer import chat_template_kwargs

        try:
            template_kw = chat_template_kwargs(model.pop("chat_template_kwargs", None), "config.model.chat_template_kwargs")
        except ValueError as e:
            raise ConfigError(str(e)) from None
        kw = {}
        for k, v in d.items():
            if k != "model":
                kw[k] = _build(nested[k], v, k) if k in nested else v
        if hf_path:
            kw["model"] = _hf_model_config(hf_path, model, kw.get("cells", CellsConfig()))
        elif "vocab_size" not in model:
            raise ConfigError("config.model.hf_path is empty and the config gives no model shape: set "
                              "--config.model.hf_path=/path/to/hf/checkpoint")
        else:
            kw["model"] = _build(ModelConfig, model, "model")
        return cls(hf_path=hf_path, hf_export=hf_export, chat_template_kwargs=template_kw, **kw)


# ModelConfig fields a config may still set when the shape comes from a checkpoint's config.json.
HF_MODEL_OVERRIDES = ("max_seq_len", "remat", "dtype", "param_dtype", "logits_temperature")
# config.model.random_init_shape=True: the section's shape fields describe the random model used when no
# checkpoint is given (configs/external.py), so --config.model.hf_path=... replaces them instead of clashing.
RANDOM_INIT_SHAPE = "random_init_shape"


def drop_random_init_shape(model: dict, hf_path: str) -> dict:
    """``model`` without its marker, and without its shape fields when a checkpoint gives the shape."""
    if not model.pop(RANDOM_INIT_SHAPE, False) or not hf_path:
        return model
    return {k: v for k, v in model.items() if k in HF_MODEL_OVERRIDES or k == "chat_template_kwargs"}


def _hf_model_config(path: str, model: Mapping[str, Any], cells: CellsConfig) -> ModelConfig:
    """ModelConfig from ``path``/config.json, vocab padded for the cells' tensor splits."""
    import math

    from gyre_jax.model.hf import config_from_hf, read_config

    bad = sorted(set(model) - set(HF_MODEL_OVERRIDES))
    if bad:
        raise ConfigError(f"config.model: {bad} come from {path}/config.json when model.hf_path is set; only "
                          f"{list(HF_MODEL_OVERRIDES)} may be given")
    try:
        cfg = config_from_hf(read_config(path), dtype=model.get("param_dtype") or None,
                             vocab_pad_multiple=math.lcm(cells.train_tensor, cells.serve_tensor),
                             max_seq_len=model.get("max_seq_len") or None)
        cfg = cfg.replace(**{k: model[k] for k in ("remat", "dtype", "logits_temperature")
                             if model.get(k) not in (None, "")})
    except (OSError, ValueError) as e:
        raise ConfigError(f"config.model.hf_path={path!r}: {e}") from None
    for knob in ("train_tensor", "serve_tensor"):  # the rules table splits these over 'tensor'
        t = getattr(cells, knob)
        bad = [f"{n}={getattr(cfg, n)}" for n in ("n_heads", "n_kv_heads", "d_ff") if getattr(cfg, n) % t]
        if bad:
            raise ConfigError(f"config.cells.{knob}={t} does not divide the checkpoint's {', '.join(bad)} "
                              f"({path}/config.json)")
    return cfg


def _build(klass, value: Mapping[str, Any], where: str):
    names = {f.name for f in dataclasses.fields(klass)}
    unknown = sorted(set(value) - names)
    if unknown:
        raise unknown_fields(where, unknown, names)
    return _built(where, lambda: klass(**dict(value)))
