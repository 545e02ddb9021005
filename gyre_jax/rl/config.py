"""RLConfig: every knob of the RL loop, one frozen section per owner, built from a config file's ConfigDict.

The sections are their owners' configs, and the consumers take them as they are:
``config.cells`` a ``CellsConfig`` (``split_cells``, the engines), ``config.scheduler`` a
``SchedulerConfig`` (the policy), ``config.task`` a ``TaskConfig`` (the task source),
``config.harness`` a ``HarnessConfig`` (the rollout runner), ``config.train`` a ``TrainConfig``
(the optimizer, the loss and the processor), ``config.sft``, ``config.eval``, ``config.faults``,
``config.metrics``; ``config.model`` is the model's shape (or ``model.hf_path``'s checkpoint).

A config file starts from ``rl_config()`` (every field at its default, so each is a flag
``--config.section.field=v`` with its type) and sets only what differs; it may start from another
config file's dict instead (``load_config``) and take sections from a third. ``RLConfig.from_config``
turns the dict (after absl's overrides) into these, and validation is complete and early: every
object the loop builds from the config is built here too, so a bad value fails in seconds, before
any JAX work, as a ``ConfigError`` whose message starts with the field's dotted name
(``config.scheduler.serve_reserve=2 must be in (0, 1]``).
"""
from __future__ import annotations

import dataclasses
import functools
import json
import math
import runpy
from typing import Any, ClassVar, Mapping

from gyre_jax.agents.config import HarnessConfig
from gyre_jax.agents.task_sources import TaskConfig
from gyre_jax.cells.config import CellsConfig
from gyre_jax.errors import ConfigError
from gyre_jax.model import ModelConfig
from gyre_jax.rl.evaluators import EvalConfig
from gyre_jax.rl.faults import FaultConfig
from gyre_jax.rl.lora_config import adapter_sources, check_lora, switch_move_bytes
from gyre_jax.rl.metrics import MetricsConfig
from gyre_jax.rl.sft_config import SFTConfig
from gyre_jax.rl.train_config import TrainConfig
from gyre_jax.scheduler.config import SchedulerConfig
from gyre_jax.schema import built, check_positive, from_mapping, knobs, to_dict, unknown_fields

# The RL job's defaults where a section's own would not fit the demo (configs/demo.py runs them as they are):
# the tiny byte-level model and a harness budgeted for it.
TINY_MODEL = ModelConfig(vocab_size=272, d_model=128, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=32, d_ff=256,
                         max_seq_len=160)
DEMO_HARNESS = HarnessConfig(max_tokens=88, max_turns=1, deadline_s=60.0, request_timeout_s=60.0, max_retries=2,
                             backoff_base_s=0.05, grader_timeout_s=30.0, system_prompt="Write the answer to answer.txt.",
                             context_budget_tokens=0, send_tools_schema=False, bytes_per_token=1.0,
                             grader_concurrency=2)
# ModelConfig fields a config may still set when the shape comes from a checkpoint's config.json.
HF_MODEL_OVERRIDES = ("max_seq_len", "remat", "dtype", "param_dtype", "logits_temperature")
MODEL_FLAGS = ("hf_path", "hf_export", "chat_template_kwargs")  # RLConfig fields spelled config.model.*
# ModelConfig's fields without a default: a checkpoint config leaves them to the checkpoint (checkpoint_model).
SHAPE_FIELDS = tuple(f.name for f in dataclasses.fields(ModelConfig)
                     if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING)
LAUNCHER_KEYS = ("job", "workdir", "recoverable_processes")  # the launcher's, not the loop's


@dataclasses.dataclass(frozen=True, kw_only=True)
class RLConfig:
    SECTION: ClassVar[str] = "config"
    seed: int = 0  # tasks, init, SFT order
    steps: int = 60  # optimizer steps (N)
    num_cpu_devices: int = 8  # host devices when running on CPU (set before JAX starts)
    first_last: int = 10  # steps averaged for the "reward first vs last" line
    checkpoint_every: int = 10  # save every k steps (0 = only at the end)
    progress: bool = True  # a bar on a terminal, one line per step otherwise
    progress_every_s: float = 60.0  # off a terminal: a line at least this often while a step runs
    model: ModelConfig = TINY_MODEL
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
    task: TaskConfig = TaskConfig(family_options={"ops": "copy", "max_len": 3})
    harness: HarnessConfig = DEMO_HARNESS
    train: TrainConfig = TrainConfig()
    sft: SFTConfig = SFTConfig()
    eval: EvalConfig = EvalConfig()
    faults: FaultConfig = FaultConfig()
    metrics: MetricsConfig = MetricsConfig()

    def __post_init__(self):
        check_positive(self, ("steps", "num_cpu_devices", "first_last", "progress_every_s"))
        if isinstance(self.checkpoint_every, bool) or not isinstance(self.checkpoint_every, int) or self.checkpoint_every < 0:
            raise ConfigError(f"config.checkpoint_every must be an int >= 0, got {self.checkpoint_every!r}")
        if self.chat_template_kwargs and not self.hf_path:
            raise ConfigError(f"config.model.chat_template_kwargs={dict(self.chat_template_kwargs)} needs "
                              "config.model.hf_path (the byte tokenizer's chat template takes no variables)")
        self._derive()
        self._check_shapes()
        self._check_built()

    def _derive(self) -> None:
        """The fields one section takes from another (never flags): the policy's steps, the rows' routing
        width, the harness's concurrency and context budget."""
        h = self.harness
        derived: dict[str, dict[str, Any]] = dict(
            scheduler=dict(total_steps=self.steps), train=dict(routing_width=self.model.routing_width),
            harness=dict(concurrency=self.scheduler.group_size, grader_ro_paths=self.task.grader_ro_path_list,
                         context_budget_tokens=h.context_budget_tokens or self.cells.max_len))
        for name, values in derived.items():
            object.__setattr__(self, name, built(name, functools.partial(dataclasses.replace, getattr(self, name),
                                                                         **values)))

    def _check_shapes(self) -> None:
        m, c, t = self.model, self.cells, self.train
        if t.row_len > m.max_seq_len:
            raise ConfigError(f"config.train.row_len={t.row_len} > model.max_seq_len={m.max_seq_len}")
        if c.max_len > m.max_seq_len:
            raise ConfigError(f"config.cells.max_len={c.max_len} > model.max_seq_len={m.max_seq_len}")
        if t.routing_replay and m.num_experts == 0:
            raise ConfigError("config.train.routing_replay=True needs a mixture-of-experts model (model.num_experts "
                              "> 0); this model is dense: nothing is routed")
        for knob in ("train_expert", "serve_expert"):  # the experts split evenly over the 'expert' axis, or not at all
            degree = getattr(c, knob)
            if degree > 1 and m.num_experts == 0:
                raise ConfigError(f"config.cells.{knob}={degree} splits a mixture-of-experts model's experts; this "
                                  "model is dense (model.num_experts=0): set it to 1")
            if degree > 1 and m.num_experts % degree:
                raise ConfigError(f"config.cells.{knob}={degree}: model.num_experts={m.num_experts} does not "
                                  "split evenly over it")
        fsdp = c.cell_size // c.train_tensor
        if t.micro_batch_rows % fsdp:
            raise ConfigError(f"config.train.micro_batch_rows={t.micro_batch_rows} must be a multiple of the "
                              f"cells' fsdp size cells.cell_size/cells.train_tensor={fsdp} (rows are split over it)")
        if self.harness.max_tokens >= c.max_len:
            raise ConfigError(f"config.harness.max_tokens={self.harness.max_tokens} must be < cells.max_len={c.max_len}")

    def _check_built(self) -> None:
        """Build (and throw away) what the loop builds later from the config: its harness, its first task,
        the warm start's demonstrations and the eval's tasks. The cell layout is checked against the devices
        (check_devices) as soon as JAX is up."""
        harness = built("harness", lambda: self.harness.make("/nonexistent.sock"))
        source = self.task_source
        first = built("task", lambda: source.train_task(0))
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
        check_lora(self)

    @functools.cached_property
    def task_source(self):
        """The run's TaskSource, built (and its file read) once."""
        return built("task", lambda: self.task.source(self.seed))

    def _check_sandbox(self, runs_commands: bool) -> None:
        """Fail closed: a harness that runs the policy's commands needs a working sandbox, or
        harness.sandbox='none' chosen explicitly."""
        if not runs_commands or self.harness.sandbox.kind != "auto":
            return
        from gyre_jax.agents.sandbox import bwrap_usable

        ok, why = bwrap_usable()
        if not ok:
            raise ConfigError(f"config.harness.sandbox='auto': {why}, and the policy's commands must not run on "
                              "this host unconfined. Install bubblewrap (apt-get install bubblewrap) or set "
                              "--config.harness.sandbox=none to run them on the host deliberately")

    def check_devices(self, n_devices: int) -> int:
        """The cells this many devices make; ConfigError if the layout cannot run."""
        c = self.cells
        if n_devices % c.cell_size:
            raise ConfigError(f"config.cells.cell_size={c.cell_size} does not divide the {n_devices} devices")
        n_cells = n_devices // c.cell_size
        self.scheduler.check_cells(n_cells, c.cell_size)
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
        return adapter_sources(self)

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
        return switch_move_bytes(self)

    def policy(self, own_costs=None):
        """config.scheduler for this run: the priors (a pilot's, or a full-weights run's switch costs) with the
        weight move rescaled to what this run's switches move (a LoRA run's adapters, not the weights;
        scheduler/costs.py: for_move_bytes), then what this workdir's earlier attempt measured over them."""
        from gyre_jax.scheduler.costs import for_move_bytes

        s = self.scheduler
        s = dataclasses.replace(s, priors=for_move_bytes(s.priors, self.switch_move_bytes), priors_file=s.priors_file)
        return s.with_own_costs(own_costs)

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

    @property
    def warm_seed(self) -> int:
        """The warm start's seed: config.sft.seed, or config.seed when that is -1."""
        return self.seed if self.sft.seed < 0 else self.sft.seed

    def to_config_dict(self):
        """This config as the ConfigDict a config file returns (every field a flag; the inverse of from_config)."""
        d = to_dict(self, RLConfig.defaults())
        for name in MODEL_FLAGS:
            d["model"][name] = d.pop(name)
        d["model"]["chat_template_kwargs"] = json.dumps(dict(self.chat_template_kwargs)) if self.chat_template_kwargs \
            else ""
        from ml_collections import config_dict

        return config_dict.ConfigDict(d)

    @classmethod
    def defaults(cls) -> "RLConfig":
        """Every field at its default, as written (nothing derived or validated): what config files start from."""
        base = cls.__new__(cls)
        for f in dataclasses.fields(cls):
            default = f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default
            object.__setattr__(base, f.name, default)
        return base

    @classmethod
    def from_config(cls, config: Any) -> "RLConfig":
        d = config.to_dict() if hasattr(config, "to_dict") else dict(config)
        d = {k: v for k, v in d.items() if k not in LAUNCHER_KEYS}
        model = dict(d.pop("model", {}))
        flags = {k: model.pop(k) for k in MODEL_FLAGS if k in model}
        if "hf_path" in flags and flags["hf_path"] is None:
            raise ConfigError("config.model.hf_path is required by this config: set "
                              "--config.model.hf_path=/path/to/hf/checkpoint")
        from gyre_jax.serving.tokenizer import chat_template_kwargs

        try:
            flags["chat_template_kwargs"] = chat_template_kwargs(flags.get("chat_template_kwargs") or None,
                                                                 "config.model.chat_template_kwargs")
        except ValueError as e:
            raise ConfigError(str(e)) from None
        known = {f.name for f in knobs(cls)} - set(MODEL_FLAGS)
        unknown = sorted(set(d) - known)
        if unknown:
            raise unknown_fields("", unknown, known)
        base = cls.defaults()  # sections not given keep them
        kw = {k: (from_mapping(type(getattr(base, k)), v, k, base=getattr(base, k)) if isinstance(v, Mapping) else v)
              for k, v in d.items()}
        hf_path = flags.get("hf_path", "")
        if not hf_path and any(model.get(k) is None for k in SHAPE_FIELDS if k in model):
            raise ConfigError("config.model.hf_path is empty and the config gives no model shape: set "
                              "--config.model.hf_path=/path/to/hf/checkpoint")
        kw["model"] = (_hf_model_config(hf_path, model, kw.get("cells", base.cells)) if hf_path
                       else from_mapping(ModelConfig, model, "model", base=TINY_MODEL))
        return cls(**kw, **flags)


def rl_config():
    """What a ``configs/*.py`` file of job 'rl' starts from: every field of RLConfig at its default (the
    demo), and the launcher's keys; set only what differs."""
    c = RLConfig.defaults().to_config_dict()
    c.job = "rl"  # gyre_jax.jobs name -> gyre_jax.rl.loop.run
    c.recoverable_processes = True  # pods (one process per cell): a satellite process may die alone
    return c


def checkpoint_model(c) -> None:
    """Make ``c`` (a config file's dict) a checkpoint config: ``model.hf_path`` is required and the model's
    shape has no default (it is the checkpoint's config.json); the config still sets max_seq_len, remat, dtypes."""
    from ml_collections.config_dict import placeholder

    c.model.hf_path = placeholder(str)
    for name in SHAPE_FIELDS:
        c.model[name] = placeholder(int)


def load_config(path: str):
    """Another config file's ConfigDict (its ``get_config()``), to start from or take sections of."""
    return runpy.run_path(path)["get_config"]()


def _hf_model_config(path: str, model: Mapping[str, Any], cells: CellsConfig) -> ModelConfig:
    """ModelConfig from ``path``/config.json, vocab padded for the cells' tensor splits; the config may change
    only HF_MODEL_OVERRIDES (its other model fields, left at their defaults, are the checkpoint's)."""
    from gyre_jax.model.hf import config_from_hf, read_config

    given = {k: v for k, v in model.items() if v is not None and getattr(TINY_MODEL, k, None) != v}
    bad = sorted(set(given) - set(HF_MODEL_OVERRIDES))
    if bad:
        raise ConfigError(f"config.model: {bad} come from {path}/config.json when model.hf_path is set; only "
                          f"{list(HF_MODEL_OVERRIDES)} may be given")
    try:
        # the overrides as the config has them, its defaults included (param_dtype float32 upcasts a bf16 file)
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


__all__ = ["HF_MODEL_OVERRIDES", "RLConfig", "checkpoint_model", "load_config", "rl_config"]
