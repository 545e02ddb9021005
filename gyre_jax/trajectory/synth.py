"""Synthetic agent rollouts as token-in/token-out records, for tests and benchmarks.

A rollout is what a long-horizon coding agent produces through the recording
proxy: a main agent whose context grows by its output plus a tool result every
call; retries (a failed call, then the same prompt again); re-tokenization drift
(the harness re-renders an earlier output into the next prompt with different
tokens); compaction (when the context would pass ``max_context`` a ``summary``
call condenses it and the agent restarts from the system prompt + summary);
sub-agents with their own context whose answer returns as a tool result;
timeouts (cut short, graded for partial credit) and infra/verifier failures
(no score). Policy versions advance every ``version_every_calls`` calls, as
with in-flight weight updates.

Context arrays are immutable and shared: a call's ``prompt_ids`` *is* the
context array (read-only), so a retry costs no copy and memory is one array per
distinct context.

Presets: ``tiny`` (tests: a few short rollouts exercising every feature) and
``paper`` (one rollout of ~300 calls, contexts up to 128K tokens, ~700K unique
tokens, ~19M recorded tokens: the scale of the paper's largest run).
"""
from __future__ import annotations

import dataclasses

import numpy as np

from gyre_jax.trajectory.records import ModelCallRecord, RolloutOutcome
from gyre_jax.trajectory.vocab import (
    ROLE_MAIN,
    ROLE_SUBAGENT,
    ROLE_SUMMARY,
    SCORED_STATUSES,
    STATUS_COMPLETED,
    STATUS_INFRA_ERROR,
    STATUS_TIMEOUT,
    STATUS_VERIFIER_ERROR,
)


@dataclasses.dataclass(frozen=True, kw_only=True)
class SynthConfig:
    run_id: str = "synth"
    seed: int = 0
    num_groups: int = 1  # tasks; one group per task
    group_size: int = 1  # rollouts per group
    calls_per_rollout: int = 12  # call budget of a full (not timed-out) rollout, all agents
    vocab_size: int = 32000
    system_prompt_len: int = 64
    task_prompt_len: int = 32
    output_len: int = 16  # mean tokens per output (gamma, shape 2)
    tool_result_len: int = 32  # mean tool-result tokens appended after each output
    max_context: int = 512  # compaction threshold (tokens of the next prompt)
    summary_len: int = 48  # tokens a summary call produces
    subagent_rate: float = 0.1  # chance a main call spawns a sub-agent
    subagent_calls: int = 3  # mean calls per sub-agent (at least 1)
    subagent_system_shared: int = 16  # leading system-prompt tokens a sub-agent shares
    retry_rate: float = 0.05  # chance a call fails (finish 'abort') and is retried on the same prompt
    drift_rate: float = 0.05  # chance the next prompt re-tokenizes one token of the previous output
    timeout_rate: float = 0.1  # rollout cut at a random point, graded for partial credit
    infra_error_rate: float = 0.02
    verifier_error_rate: float = 0.02
    version_every_calls: int = 0  # policy version += 1 every this many calls (0: never)

    def __post_init__(self):
        for f in ("num_groups", "group_size", "calls_per_rollout", "vocab_size", "system_prompt_len",
                  "task_prompt_len", "output_len", "tool_result_len", "summary_len", "subagent_calls"):
            if getattr(self, f) < 1:
                raise ValueError(f"SynthConfig.{f}={getattr(self, f)} must be >= 1")
        for f in ("subagent_rate", "retry_rate", "drift_rate", "timeout_rate", "infra_error_rate", "verifier_error_rate"):
            if not 0.0 <= getattr(self, f) <= 1.0:
                raise ValueError(f"SynthConfig.{f}={getattr(self, f)} must be in [0, 1]")
        if self.timeout_rate + self.infra_error_rate + self.verifier_error_rate > 1.0:
            raise ValueError("SynthConfig: timeout_rate + infra_error_rate + verifier_error_rate must be <= 1")
        floor = self.system_prompt_len + self.task_prompt_len + self.summary_len + 8
        if self.max_context < 2 * floor:
            raise ValueError(f"SynthConfig.max_context={self.max_context} must be >= {2 * floor} (twice system + task + summary)")
        if not 0 <= self.subagent_system_shared <= self.system_prompt_len:
            raise ValueError(f"SynthConfig.subagent_system_shared={self.subagent_system_shared} must be in [0, system_prompt_len]")
        if self.version_every_calls < 0:
            raise ValueError("SynthConfig.version_every_calls must be >= 0")


PRESETS: dict[str, SynthConfig] = {
    "tiny": SynthConfig(seed=2, num_groups=2, group_size=4, calls_per_rollout=10, vocab_size=1000, system_prompt_len=8,
                        task_prompt_len=6, output_len=5, tool_result_len=8, max_context=120, summary_len=6,
                        subagent_rate=0.3, subagent_calls=2, subagent_system_shared=4, retry_rate=0.2,
                        drift_rate=0.2, timeout_rate=0.2, infra_error_rate=0.1, verifier_error_rate=0.1,
                        version_every_calls=4),
    # ~300 calls, contexts up to 128K, ~700K unique tokens per rollout.
    "paper": SynthConfig(calls_per_rollout=300, vocab_size=151_936, system_prompt_len=12_000, task_prompt_len=2_000,
                         output_len=500, tool_result_len=1_900, max_context=131_072, summary_len=3_000,
                         subagent_rate=0.04, subagent_calls=6, subagent_system_shared=4_000, retry_rate=0.03,
                         drift_rate=0.02, timeout_rate=0.0, infra_error_rate=0.0, verifier_error_rate=0.0,
                         version_every_calls=40),
}


def preset(name: str, **overrides) -> SynthConfig:
    try:
        base = PRESETS[name]
    except KeyError:
        raise LookupError(f"unknown synth preset {name!r}; known: {sorted(PRESETS)}") from None
    return dataclasses.replace(base, **overrides)


def _frozen(a: np.ndarray) -> np.ndarray:
    a = np.ascontiguousarray(a, dtype=np.int32)
    a.flags.writeable = False
    return a


class _Roll:
    """Mutable state while generating one rollout."""

    def __init__(self, cfg: SynthConfig, rng: np.random.Generator, ids: dict, version0: int):
        self.cfg, self.rng, self.ids, self.version0 = cfg, rng, ids, version0
        self.calls: list[ModelCallRecord] = []
        self.t = 1.7e9 + float(rng.random()) * 1e5
        self.versions: set[int] = set()

    def tokens(self, n: int) -> np.ndarray:
        return self.rng.integers(0, self.cfg.vocab_size, n, dtype=np.int32)

    def length(self, mean: int) -> int:
        return max(1, int(self.rng.gamma(2.0, mean / 2.0)))

    def call(self, prompt, n_out, *, agent, parent, role, finish="stop") -> np.ndarray:
        out = _frozen(self.tokens(n_out))
        k = len(self.calls)
        v = self.version0 + (k // self.cfg.version_every_calls if self.cfg.version_every_calls else 0)
        t0, self.t = self.t, self.t + 0.5 + 1e-5 * prompt.shape[0] + 0.02 * n_out
        self.calls.append(ModelCallRecord(
            **self.ids, agent_id=agent, parent_agent_id=parent, role=role, call_index=k, prompt_ids=prompt,
            output_ids=out, output_logprobs=-self.rng.exponential(0.4, n_out).astype(np.float32),
            policy_version=v, t_start=t0, t_end=self.t, finish_reason=finish))
        self.versions.add(v)
        return out

    def turn(self, ctx, *, agent, parent, role, n_out) -> np.ndarray:
        """One call on ctx, with a failed attempt first at retry_rate; returns the kept output."""
        if self.rng.random() < self.cfg.retry_rate:
            self.call(ctx, max(1, n_out // 3), agent=agent, parent=parent, role=role, finish="abort")
        return self.call(ctx, n_out, agent=agent, parent=parent, role=role)

    def render(self, out: np.ndarray) -> np.ndarray:
        """The output as the harness puts it back into the next prompt (maybe re-tokenized)."""
        if out.shape[0] and self.rng.random() < self.cfg.drift_rate:
            k = int(self.rng.integers(out.shape[0]))
            return np.concatenate([out[:k], self.tokens(2), out[k + 1 :]])
        return out


def synth_rollout(cfg: SynthConfig, group: int, index: int) -> tuple[list[ModelCallRecord], RolloutOutcome]:
    """One rollout of task ``group`` (deterministic in cfg.seed, group, index)."""
    rng = np.random.default_rng([cfg.seed, group, index])
    task_rng = np.random.default_rng([cfg.seed, group])  # shared by the group: same system + task prompt
    ids = dict(run_id=cfg.run_id, rollout_id=f"{cfg.run_id}-g{group}-r{index}", task_id=f"task-{group}", group_id=f"g{group}")
    st = _Roll(cfg, rng, ids, version0=group)
    system = task_rng.integers(0, cfg.vocab_size, cfg.system_prompt_len, dtype=np.int32)
    task = task_rng.integers(0, cfg.vocab_size, cfg.task_prompt_len, dtype=np.int32)
    u = rng.random()
    status = (STATUS_INFRA_ERROR if u < cfg.infra_error_rate else
              STATUS_VERIFIER_ERROR if u < cfg.infra_error_rate + cfg.verifier_error_rate else
              STATUS_TIMEOUT if u < cfg.infra_error_rate + cfg.verifier_error_rate + cfg.timeout_rate else
              STATUS_COMPLETED)
    budget = cfg.calls_per_rollout
    if status != STATUS_COMPLETED:  # cut short (a timeout, or the infra failing mid-way)
        budget = int(rng.integers(1, cfg.calls_per_rollout + 1))
    ctx = _frozen(np.concatenate([system, task]))
    next_agent = 1
    while len(st.calls) < budget:
        out = st.turn(ctx, agent=0, parent=None, role=ROLE_MAIN, n_out=st.length(cfg.output_len))
        if len(st.calls) + 1 < budget and rng.random() < cfg.subagent_rate:
            agent, next_agent = next_agent, next_agent + 1
            sub = _frozen(np.concatenate([system[: cfg.subagent_system_shared], st.tokens(32), st.render(out)]))
            n_sub = max(1, int(rng.poisson(cfg.subagent_calls)))
            answer = out
            for _ in range(n_sub):
                if len(st.calls) >= budget:
                    break
                answer = st.turn(sub, agent=agent, parent=0, role=ROLE_SUBAGENT, n_out=st.length(cfg.output_len))
                sub = _frozen(np.concatenate([sub, st.render(answer), st.tokens(st.length(cfg.tool_result_len))]))
            result = np.concatenate([st.tokens(4), st.render(answer)])  # the sub-agent's answer as a tool result
        else:
            result = st.tokens(st.length(cfg.tool_result_len))
        nxt = np.concatenate([ctx, st.render(out), result])
        if nxt.shape[0] + cfg.output_len * 4 + cfg.tool_result_len * 4 > cfg.max_context and len(st.calls) < budget:
            # Compaction: summarize this context, restart from system + task + summary.
            instr = st.tokens(16)
            summ = st.call(_frozen(np.concatenate([nxt[: cfg.max_context - 16], instr])),
                           st.length(cfg.summary_len), agent=0, parent=None, role=ROLE_SUMMARY)
            nxt = np.concatenate([system, task, st.tokens(8), st.render(summ)])
        ctx = _frozen(nxt)
    details: dict[str, object]
    if status in SCORED_STATUSES:
        score = float(rng.beta(2, 2)) if status == STATUS_COMPLETED else float(rng.beta(1, 3))
        total = 20
        details = {"synthetic": True, "tests_total": total, "tests_passed": int(round(score * total))}
    else:
        score, details = None, {"synthetic": True, "error": f"synthetic {status}"}
    outcome = RolloutOutcome(**ids, status=status, score=score, details=details, policy_versions=tuple(sorted(st.versions)),
                             t_end=st.t + 1.0, num_calls=len(st.calls))
    return st.calls, outcome


def synth_rollouts(cfg: SynthConfig) -> tuple[list[ModelCallRecord], list[RolloutOutcome]]:
    """Every rollout of every group: (all calls, all outcomes), rollout by rollout."""
    calls, outcomes = [], []
    for g in range(cfg.num_groups):
        for i in range(cfg.group_size):
            c, o = synth_rollout(cfg, g, i)
            calls.extend(c)
            outcomes.append(o)
    return calls, outcomes
