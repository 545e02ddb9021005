"""The one small interface between the proxy/router and an inference engine.

A ``Backend`` serves one cell. The router only ever does four things with it:

* ``submit(GenerateRequest) -> TokenStream``: start a call; the stream yields one
  ``TokenEvent`` (token id + behavior log-prob, + routing for an MoE engine) per generated token and then
  ends with ``stream.finish`` set to ``"stop"`` (a stop id was produced; it is the
  last token yielded), ``"length"`` (max_tokens or the context was reached),
  ``"moved"`` (exported, see below) or ``"cancelled"``. An engine failure for
  this call raises ``EngineError`` from the stream (other calls are unaffected).
* ``cancel(request_id)``: stop generating for it; its stream ends "cancelled".
* ``export(request_id) -> bool``: stop the call at a token boundary here; True if
  it will be moved (False: it already finished). Its stream then ends "moved"
  after exactly the tokens generated here, and ``stream.resume`` holds a
  ResumeState with everything needed to continue it elsewhere: the tokens so
  far and (when the engine can) its KV prefix as device arrays.
* import: ``submit(GenerateRequest(..., resume=state))`` on another backend
  continues the call: with ``state.kv`` the prefix is copied, not recomputed;
  with ``kv=None`` the backend recomputes it from the tokens (the fallback), an MoE
  engine replaying the generated tokens' recorded routing (``state.output_routing``), so
  the recomputed cache is the one decode built.

Sampling is a pure function of (seed, number of tokens generated so far) and the
logits, so a continued call produces exactly what the undisturbed call would have.
Implementations: ``jetstream_backend.JetStreamBackend`` (GyreEngine driven by
JetStream's orchestrator) and ``gyre_jax.testing.fake_backend.FakeBackend``.
"""
from __future__ import annotations

import abc
import dataclasses
import math
from typing import Any, AsyncIterator

import numpy as np

MAX_STOP_IDS = 8  # stop ids per request (the engine keeps them in a fixed-size array)
FINISHES = ("stop", "length", "moved", "cancelled")


class EngineError(RuntimeError):
    """The engine failed this request (the server keeps running)."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class SamplingParams:
    """temperature 0 = greedy. top_p in (0, 1]. max_tokens counts generated tokens."""

    max_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    seed: int = 0
    stop_ids: tuple[int, ...] = ()
    adapter: int = 0  # multi-LoRA: which of the engine's adapters samples (the proxy sets it from the rollout's key)

    def __post_init__(self):
        w = "SamplingParams"
        if isinstance(self.adapter, bool) or not isinstance(self.adapter, (int, np.integer)) or self.adapter < 0:
            raise ValueError(f"{w}.adapter must be an int >= 0, got {self.adapter!r}")
        object.__setattr__(self, "adapter", int(self.adapter))
        if isinstance(self.max_tokens, bool) or not isinstance(self.max_tokens, (int, np.integer)) or self.max_tokens < 1:
            raise ValueError(f"{w}.max_tokens must be an int >= 1, got {self.max_tokens!r}")
        t = self.temperature
        if isinstance(t, bool) or not isinstance(t, (int, float)) or not math.isfinite(t) or not 0 <= t <= 100:
            raise ValueError(f"{w}.temperature must be a number in [0, 100], got {t!r}")
        p = self.top_p
        if isinstance(p, bool) or not isinstance(p, (int, float)) or not (0 < p <= 1):
            raise ValueError(f"{w}.top_p must be a number in (0, 1], got {p!r}")
        if isinstance(self.seed, bool) or not isinstance(self.seed, (int, np.integer)) or not 0 <= self.seed < 2**31:
            raise ValueError(f"{w}.seed must be an int in [0, 2**31), got {self.seed!r}")
        stop = tuple(self.stop_ids)
        if len(stop) > MAX_STOP_IDS:
            raise ValueError(f"{w}.stop_ids: at most {MAX_STOP_IDS} stop ids, got {len(stop)}")
        for s in stop:
            if isinstance(s, bool) or not isinstance(s, (int, np.integer)) or s < 0:
                raise ValueError(f"{w}.stop_ids: {s!r} is not a token id")
        object.__setattr__(self, "stop_ids", tuple(int(s) for s in stop))
        object.__setattr__(self, "max_tokens", int(self.max_tokens))
        object.__setattr__(self, "seed", int(self.seed))


@dataclasses.dataclass(frozen=True, kw_only=True, eq=False)
class ResumeState:
    """A call stopped at a token boundary: enough to continue it anywhere.

    ``kv`` (engine-specific, e.g. device arrays of the first
    ``len(prompt_ids) + len(output_ids) - 1`` positions) is None when only a
    recompute is possible.
    """

    prompt_ids: np.ndarray  # int32[P]
    output_ids: np.ndarray  # int32[G] streamed so far
    output_logprobs: np.ndarray  # float32[G]
    kv: Any = None
    source: str = ""  # backend name it came from (for logs/metrics)
    # An MoE engine's TokenEvent.routing of each output token, uint8/uint16 [G, R] (None: not recorded)
    output_routing: np.ndarray | None = None

    @property
    def num_generated(self) -> int:
        return int(self.output_ids.shape[0])

    def without_kv(self) -> "ResumeState":
        return dataclasses.replace(self, kv=None)


@dataclasses.dataclass(frozen=True, kw_only=True, eq=False)
class GenerateRequest:
    request_id: str
    prompt_ids: np.ndarray  # int32[P], P >= 1
    sampling: SamplingParams
    resume: ResumeState | None = None  # continue a moved call (prompt_ids must match)
    cache_key: str | None = None  # e.g. "run/rollout/agent": prefix-cache affinity hint

    def __post_init__(self):
        p = np.asarray(self.prompt_ids, dtype=np.int32).reshape(-1)
        if p.shape[0] < 1:
            raise ValueError(f"GenerateRequest({self.request_id}).prompt_ids: needs at least 1 token")
        object.__setattr__(self, "prompt_ids", p)
        if self.resume is not None:
            if not np.array_equal(self.resume.prompt_ids, p):
                raise ValueError(f"GenerateRequest({self.request_id}).resume: prompt differs from the request's")
            if self.resume.num_generated >= self.sampling.max_tokens:
                raise ValueError(f"GenerateRequest({self.request_id}).resume: already has max_tokens tokens")
            r = self.resume.output_routing
            if r is not None and (np.ndim(r) != 2 or len(r) != self.resume.num_generated):
                raise ValueError(f"GenerateRequest({self.request_id}).resume.output_routing: needs one row per output "
                                 f"token ({self.resume.num_generated}), got shape {np.shape(r)}")


@dataclasses.dataclass(frozen=True)
class TokenEvent:
    token_id: int
    logprob: float
    # An MoE engine: uint8/uint16 [R] experts every MoE layer chose at the step that sampled this
    # token (recorded for routing replay); None where the engine records none.
    routing: Any = None


class TokenStream(abc.ABC):
    """Async iterator of TokenEvent; ``finish`` and ``resume`` are set once it ends."""

    request_id: str
    finish: str | None = None
    resume: ResumeState | None = None

    def __aiter__(self) -> AsyncIterator[TokenEvent]:
        return self

    @abc.abstractmethod
    async def __anext__(self) -> TokenEvent:
        ...


class Backend(abc.ABC):
    """One cell's engine, as the router sees it."""

    name: str
    max_context: int  # prompt tokens + max_tokens may not exceed this
    capacity: int  # concurrent decode slots

    @abc.abstractmethod
    def submit(self, request: GenerateRequest) -> TokenStream:
        """Start a call (call from the event loop). Raises ValueError for a bad request."""

    @abc.abstractmethod
    def cancel(self, request_id: str) -> None:
        ...

    @abc.abstractmethod
    async def export(self, request_id: str) -> bool:
        """Stop at a token boundary for a move; the stream then ends "moved" (see module doc)."""

    @abc.abstractmethod
    def num_active(self) -> int:
        """Calls submitted and not yet finished (the router's load measure)."""

    @property
    @abc.abstractmethod
    def policy_version(self) -> int:
        ...

    @abc.abstractmethod
    def stats(self) -> dict[str, float]:
        """Counters for /metrics; must include 'prefill_tokens' (tokens run through prefill)."""

    async def close(self) -> None:
        return None
