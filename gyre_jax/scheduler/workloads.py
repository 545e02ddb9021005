"""Workload and cluster models for the simulator, and the rollout sampler.

A rollout is an agent run: ``n_calls`` model calls, each followed by a tool call
(except the last). A model call occupies one serving *slot* of a rollout cell for
``context_tokens / prefill_tok_s + decode_tokens / decode_tok_s`` seconds: decode
speed per sequence is flat up to the slot count (long-context serving is bound by
KV-cache memory, which caps concurrent sequences), and calls beyond the free
slots queue at the proxy. Tool calls use no accelerator. Heavy tails come from the
number of calls per rollout (lognormal or Pareto) and from tool latency
(lognormal). A harness deadline ends a rollout early; it is graded for partial
credit and trained on like any other (never dropped).

Training a rollout costs its tokens (everything appended to its context: tool
outputs, prompts and generated tokens, i.e. the prefix-shared tree) divided by a
cell's training throughput; data parallelism over cells is taken as linear.

All rollouts of a run are sampled up front from one seed, in launch order, so
every mode of a comparison sees the same tasks (common random numbers).
"""
from __future__ import annotations

import dataclasses
import math

import numpy as np

from gyre_jax.scheduler.policy import Measured, PolicyConfig

CALL_DISTS = ("lognormal", "pareto")


def _positive(obj, *names):
    for n in names:
        v = getattr(obj, n)
        if not (v > 0):
            raise ValueError(f"{type(obj).__name__}.{n}={v} must be > 0")


@dataclasses.dataclass(frozen=True, kw_only=True)
class WorkloadConfig:
    name: str
    calls_dist: str = "lognormal"  # distribution of model calls per rollout
    calls_median: float  # median model calls per rollout
    calls_shape: float  # lognormal sigma, or Pareto alpha (smaller = heavier tail)
    calls_max: int  # harness turn budget
    decode_tokens_median: float  # generated tokens per call (lognormal)
    decode_tokens_sigma: float
    context_tokens_median: float  # new input tokens per call: tool output, prompt (lognormal)
    context_tokens_sigma: float
    decode_tok_s: float  # decode speed of one sequence on a rollout cell
    prefill_tok_s: float  # prefill speed of one sequence (prefix already cached)
    tool_s_median: float  # tool latency after each call (lognormal)
    tool_s_sigma: float
    rollout_timeout_s: float = math.inf  # harness deadline from launch; inf = none
    train_tokens_per_s_per_cell: float  # forward+backward tokens/s of one training cell
    optimizer_s: float  # gradient reduce + optimizer update on the core, per step
    # Drift: rollouts grow as the policy learns (agents take more turns and write more per
    # turn). Calls per rollout and tokens per call (generated and new context alike) are
    # scaled by factors rising linearly with launch order from 1 (first rollout) to these
    # (last rollout). 1 = no drift. calls_max scales with drift_calls.
    drift_calls: float = 1.0
    drift_tokens: float = 1.0
    # Mixtures: a fraction of rollouts (drawn independently) take `long_factor` x the calls
    # (bimodal lengths: quick fixes and rewrites; giant rollouts: a rare one that runs for
    # hours). 0 = none. calls_max caps them as it caps the rest.
    long_fraction: float = 0.0
    long_factor: float = 1.0

    def __post_init__(self):
        if self.calls_dist not in CALL_DISTS:
            raise ValueError(f"WorkloadConfig({self.name}).calls_dist={self.calls_dist!r}; known: {CALL_DISTS}")
        _positive(self, "calls_median", "calls_shape", "decode_tokens_median", "context_tokens_median",
                  "decode_tok_s", "prefill_tok_s", "train_tokens_per_s_per_cell", "rollout_timeout_s")
        for n in ("decode_tokens_sigma", "context_tokens_sigma", "tool_s_sigma", "tool_s_median", "optimizer_s"):
            if getattr(self, n) < 0:
                raise ValueError(f"WorkloadConfig({self.name}).{n}={getattr(self, n)} must be >= 0")
        for n in ("drift_calls", "drift_tokens"):
            if not getattr(self, n) > 0:
                raise ValueError(f"WorkloadConfig({self.name}).{n}={getattr(self, n)} must be > 0")
        if not 0 <= self.long_fraction <= 1 or not self.long_factor >= 1:
            raise ValueError(f"WorkloadConfig({self.name}).long_fraction={self.long_fraction} must be in [0, 1] and "
                             f"long_factor={self.long_factor} >= 1")
        if self.calls_max < 1 or self.calls_max < self.calls_median:
            raise ValueError(f"WorkloadConfig({self.name}).calls_max={self.calls_max} must be >= max(1, calls_median)")


@dataclasses.dataclass(frozen=True, kw_only=True)
class ClusterConfig:
    accelerators: int  # total accelerators
    cell_size: int  # accelerators per cell (smallest group holding the training layout)
    slots_per_cell: int  # concurrent model calls per rollout cell (KV-cache bound)
    switch_to_train_s: float = 8.5  # paper: 8.52 s mean rollout -> train
    switch_to_rollout_s: float = 3.5  # paper: 3.46 s mean train -> rollout
    kv_move_s: float = 0.5  # assumption: one in-flight call's KV moved over RDMA on drain
    publish_s: float = 30.0  # assumption: core -> rollout cells weight broadcast

    def __post_init__(self):
        _positive(self, "accelerators", "cell_size", "slots_per_cell")
        if self.accelerators % self.cell_size:
            raise ValueError(f"ClusterConfig: accelerators={self.accelerators} is not a multiple of cell_size={self.cell_size}")
        for n in ("switch_to_train_s", "switch_to_rollout_s", "kv_move_s", "publish_s"):
            if getattr(self, n) < 0:
                raise ValueError(f"ClusterConfig.{n}={getattr(self, n)} must be >= 0")

    @property
    def n_cells(self) -> int:
        return self.accelerators // self.cell_size


@dataclasses.dataclass(frozen=True, kw_only=True)
class SimConfig:
    cluster: ClusterConfig
    workload: WorkloadConfig
    policy: PolicyConfig
    seed: int = 0  # seeds the sampled rollouts (every mode of a comparison gets the same ones)
    # Model calls merged into one simulated call (1 = exact). Merging k consecutive calls
    # keeps each rollout's total call time, tool time and tokens; it only makes slot holds
    # longer and fewer. A speed knob for the largest runs; its effect is measured in
    # tools/bench_scheduler.py.
    call_merge: int = 1
    # Elastic's priors (PolicyConfig.priors) when the policy sets none: the costs of the first
    # step's sampled rollouts and the cluster's switch costs, what a pilot run measures before
    # one commits to a run (the async baseline's first-step split uses the same). False: the
    # policy starts blind (core alone, switch cost min_work_per_switch_s) as the RL loop does
    # without priors in its config.
    model_priors: bool = True

    def __post_init__(self):
        if self.call_merge < 1:
            raise ValueError(f"SimConfig.call_merge={self.call_merge} must be >= 1")
        if self.cluster.n_cells < self.policy.strategy.min_cells:
            raise ValueError(f"SimConfig: mode {self.policy.mode!r} needs >= {self.policy.strategy.min_cells} cells, "
                             f"cluster has {self.cluster.n_cells}")

    @property
    def publish_delay_s(self) -> float:
        """A colocated mode's rollout and training share devices: new weights are loaded as
        part of its train -> rollout switch, with no broadcast; the other modes broadcast."""
        return 0.0 if self.policy.strategy.colocated else self.cluster.publish_s

    def replace(self, **kw) -> "SimConfig":
        """Override fields by dotted path: replace(**{'policy.mode': 'async'})."""
        parts: dict[str, dict] = {}
        top = {}
        for k, v in kw.items():
            head, _, rest = k.partition(".")
            if rest:
                parts.setdefault(head, {})[rest] = v
            else:
                top[k] = v
        for head, fields in parts.items():
            top[head] = dataclasses.replace(getattr(self, head), **fields)
        return dataclasses.replace(self, **top)


@dataclasses.dataclass(frozen=True)
class Rollouts:
    """Sampled rollouts, flat. Rollout r's calls are [offsets[r], offsets[r+1])."""

    offsets: list[int]
    call_s: list[float]  # slot-seconds of each model call
    tool_s: list[float]  # tool latency after each call (the last one unused)
    tokens: list[float]  # tokens each call appends to the rollout's context

    @property
    def n(self) -> int:
        return len(self.offsets) - 1


def drift_factor(final: float, n: int) -> np.ndarray:
    """Per-rollout scale, rising linearly with launch order from 1 to `final`."""
    return 1.0 + (final - 1.0) * np.arange(n) / max(n - 1, 1)


def sample_calls(w: WorkloadConfig, n: int, rng: np.random.Generator) -> np.ndarray:
    if w.calls_dist == "lognormal":
        x = rng.lognormal(math.log(w.calls_median), w.calls_shape, n)
    else:  # Pareto with the given median: scale * 2**(1/alpha) = median
        scale = w.calls_median / 2.0 ** (1.0 / w.calls_shape)
        x = scale * (1.0 + rng.pareto(w.calls_shape, n))
    if w.long_fraction > 0:  # drawn only then: the other workloads keep their samples
        x = np.where(rng.random(n) < w.long_fraction, x * w.long_factor, x)
    if w.drift_calls != 1.0:
        x = x * drift_factor(w.drift_calls, n)
    return np.clip(np.round(x), 1, max(w.calls_max, round(w.calls_max * w.drift_calls))).astype(np.int64)


def _lognormal(rng: np.random.Generator, median: float, sigma: float, n: int) -> np.ndarray:
    # float32 normals: a third of rng.lognormal's time at the tens of millions of calls of an
    # 8K-accelerator run (relative precision 1e-7, far below what the model knows)
    z = rng.standard_normal(n, dtype=np.float32)
    z *= np.float32(sigma)
    z += np.float32(math.log(median))
    return np.exp(z, out=z).astype(np.float64)


def sample_rollouts(w: WorkloadConfig, n: int, seed: int, *, merge: int = 1) -> Rollouts:
    """All rollouts of a run, drawn from `seed`. Calls are drawn (and merged) a block of
    rollouts at a time: an 8K-accelerator run has ~75M calls, and whole-run arrays of them
    cost more in page faults than in arithmetic."""
    rng = np.random.default_rng(seed)
    calls = sample_calls(w, n, rng)
    tok_drift = drift_factor(w.drift_tokens, n) if w.drift_tokens != 1.0 else None
    block = max(1, int(2_000_000 // max(1.0, float(calls.mean()))))
    parts: list[tuple[np.ndarray, ...]] = []
    for r0 in range(0, n, block):
        c = calls[r0:r0 + block]
        total = int(c.sum())
        decode = _lognormal(rng, w.decode_tokens_median, w.decode_tokens_sigma, total)
        context = _lognormal(rng, w.context_tokens_median, w.context_tokens_sigma, total)
        tool = _lognormal(rng, w.tool_s_median, w.tool_s_sigma, total) if w.tool_s_median > 0 else np.zeros(total)
        if tok_drift is not None:
            per_call = np.repeat(tok_drift[r0:r0 + block], c)
            decode *= per_call
            context *= per_call
        call_s = context / w.prefill_tok_s + decode / w.decode_tok_s
        tokens = decode + context
        k = c
        if merge > 1:
            k = -(-c // merge)
            first = np.concatenate([[0], np.cumsum(k)])
            offs = np.concatenate([[0], np.cumsum(c)])
            owner = np.repeat(np.arange(len(c)), k)
            starts = offs[owner] + merge * (np.arange(first[-1]) - first[owner])
            call_s, tool, tokens = (np.add.reduceat(x, starts) for x in (call_s, tool, tokens))
        parts.append((k, call_s, tool, tokens))
    offsets = np.concatenate([[0], np.cumsum(np.concatenate([p[0] for p in parts]))])
    call_s, tool, tokens = (np.concatenate([p[i] for p in parts]) for i in (1, 2, 3))
    return Rollouts(offsets.tolist(), call_s.tolist(), tool.tolist(), tokens.tolist())


def rollouts_for(config: SimConfig) -> Rollouts:
    p = config.policy
    return sample_rollouts(config.workload, p.total_steps * p.groups_per_step * p.group_size, config.seed,
                           merge=config.call_merge)


def first_steps(rollouts: Rollouts, per_step: int, steps: int) -> Rollouts:
    """The first ``per_step`` rollouts, repeated ``steps`` times (a pilot's workload: what it saw)."""
    a, b = rollouts.offsets[0], rollouts.offsets[per_step]
    offsets = [0] + [o - a + i * (b - a) for i in range(steps) for o in rollouts.offsets[1:per_step + 1]]
    return Rollouts(offsets, rollouts.call_s[a:b] * steps, rollouts.tool_s[a:b] * steps, rollouts.tokens[a:b] * steps)


def work_split(config: SimConfig, rollouts: Rollouts) -> tuple[float, float]:
    """(serving, training) cell-seconds of the sampled workload, ignoring deadlines."""
    serve = sum(rollouts.call_s) / config.cluster.slots_per_cell
    train = sum(rollouts.tokens) / config.workload.train_tokens_per_s_per_cell
    return serve, train


def pilot_priors(config: SimConfig, rollouts: Rollouts) -> Measured:
    """The costs a pilot measures on the first step's rollouts (PolicyConfig.priors): serving
    and training cell-seconds per rollout, the optimizer update, the switch costs (each direction and
    their round trip)."""
    p = config.policy
    n = min(rollouts.n, p.groups_per_step * p.group_size)
    a, b = rollouts.offsets[0], rollouts.offsets[n]
    c, w = config.cluster, config.workload
    return Measured(serve_s_per_rollout=sum(rollouts.call_s[a:b]) / c.slots_per_cell / n,
                    work_s_per_rollout=sum(rollouts.tokens[a:b]) / w.train_tokens_per_s_per_cell / n,
                    update_s=w.optimizer_s, switch_round_trip_s=c.switch_to_train_s + c.switch_to_rollout_s,
                    switch_to_train_s=c.switch_to_train_s, switch_to_rollout_s=c.switch_to_rollout_s)


def balanced_async_split(config: SimConfig, rollouts: Rollouts | None = None) -> int:
    """Training cells for the async baseline: the share of the work that is training
    (a-priori balance of the two pools; the benchmark also sweeps around it)."""
    rollouts = rollouts or rollouts_for(config)
    serve, train = work_split(config, rollouts)
    n = config.cluster.n_cells
    return int(min(n - 1, max(1, round(n * train / (serve + train)))))


def mean_call_s(w: WorkloadConfig) -> float:
    """Expected slot-seconds of one model call (lognormal means)."""
    ctx = w.context_tokens_median * math.exp(w.context_tokens_sigma**2 / 2)
    dec = w.decode_tokens_median * math.exp(w.decode_tokens_sigma**2 / 2)
    return ctx / w.prefill_tok_s + dec / w.decode_tok_s


def call_duty(w: WorkloadConfig) -> float:
    """Expected fraction of an agent's time spent in model calls (vs tools)."""
    call = mean_call_s(w)
    tool = w.tool_s_median * math.exp(w.tool_s_sigma**2 / 2)
    return call / (call + tool)


def batch_filling_cluster(cluster: ClusterConfig, w: WorkloadConfig, group_size: int) -> int:
    """Groups per step such that one step's rollouts, all running, offer about as many
    concurrent calls as the whole cluster has serving slots: how a colocated run sizes
    its batch to its hardware (fewer leaves serving idle, more only queues)."""
    rollouts = cluster.n_cells * cluster.slots_per_cell / call_duty(w)
    return max(1, math.floor(rollouts / group_size))
