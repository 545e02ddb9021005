"""FakeBackend: a deterministic, JAX-free ``Backend`` for proxy and router tests.

Its "model" is a pure function of the token sequence so far (``script``; by
default a hash of the last tokens; ``script_for(request)`` picks a script per
call, e.g. from its rollout), so outputs are reproducible and a call moved
between fake cells must continue with exactly the tokens it would have produced.
Tokens are produced only as the consumer pulls (one ``await`` per token), so a
test controls precisely how far a call has got when it drains a cell. The "KV"
it exports is the list of tokens whose k/v a real engine would hold; importing
it counts no prefill tokens, a recompute counts them all (``stats``).

Fault injection: ``fail_when(request) -> bool`` makes that call raise
EngineError at its first token; ``fail_imports`` makes every KV import fail.
``on_export(request_id)`` is called after each export and ``before_token(request,
n)`` is awaited before each token (to sequence tests, e.g. hold a call open).
"""
from __future__ import annotations

import asyncio
import collections
from typing import Awaitable, Callable, Sequence

import numpy as np

from gyre_jax.serving.backend import Backend, EngineError, GenerateRequest, ResumeState, TokenEvent, TokenStream


def default_script(seq: Sequence[int]) -> int:
    """Next token: a small hash of the last three tokens and the length (a byte)."""
    a = [int(t) for t in seq[-3:]]
    return (sum((i + 1) * t for i, t in enumerate(a)) * 7 + len(seq) * 13) % 256


class _FakeStream(TokenStream):
    def __init__(self, b: "FakeBackend", req: GenerateRequest):
        self.request_id, self._b, self._req = req.request_id, b, req
        r = req.resume
        self.tokens = [] if r is None else [int(t) for t in r.output_ids]
        self.logprobs = [] if r is None else [float(x) for x in r.output_logprobs]
        self._script = b.script if b.script_for is None else b.script_for(req)
        self._fail = b.fail_when is not None and b.fail_when(req)
        self._fail_import = b.fail_imports and r is not None and r.kv is not None
        self._state = "running"  # running | moved | cancelled | done
        self.finish = None
        self.resume = None
        seq_len = len(req.prompt_ids) + len(self.tokens) - 1
        if r is not None and r.kv is not None and not self._fail_import:
            b.counters["moved_tokens"] += len(r.kv)
        else:
            b.counters["prefill_tokens"] += seq_len

    async def __anext__(self) -> TokenEvent:
        await asyncio.sleep(0)  # one scheduling point per token, like a decode step
        if self._b.before_token is not None and self._state == "running":
            await self._b.before_token(self._req, len(self.tokens))
        if self._fail or self._fail_import:
            self._end("error")
            raise EngineError(f"{self._b.name}: injected failure for {self.request_id}")
        if self._state == "moved":
            seq = [int(t) for t in self._req.prompt_ids] + self.tokens
            self._end("moved")
            self.resume = ResumeState(prompt_ids=self._req.prompt_ids, output_ids=np.asarray(self.tokens, np.int32),
                                      output_logprobs=np.asarray(self.logprobs, np.float32), kv=seq[:-1],
                                      source=self._b.name)
            raise StopAsyncIteration
        if self._state != "running":
            self._end(self._state)
            raise StopAsyncIteration
        sp = self._req.sampling
        seq = [int(t) for t in self._req.prompt_ids] + self.tokens
        tok = int(self._script(seq))
        lp = -0.25 * (1 + tok % 4)
        self.tokens.append(tok)
        self.logprobs.append(lp)
        self._b.counters["generated_tokens"] += 1
        if tok in sp.stop_ids:
            self._state = "stop"
        elif len(self.tokens) >= sp.max_tokens:
            self._state = "length"
        if self._state != "running":
            self._end(self._state)
        return TokenEvent(tok, lp)

    def _end(self, finish: str) -> None:
        if self.finish is None:
            self.finish = finish
            self._b.forget(self.request_id)

    @property
    def running(self) -> bool:
        return self._state == "running"

    def cancel(self) -> None:
        """The consumer is gone: end now (the backend's cancel)."""
        self._state = "cancelled"
        self._end("cancelled")

    def move(self) -> None:
        """Ends at its next token with its state to resume elsewhere (the backend's export)."""
        self._state = "moved"


class FakeBackend(Backend):
    def __init__(self, name: str, *, vocab_size: int = 272, capacity: int = 8, max_context: int = 512,
                 script: Callable[[Sequence[int]], int] = default_script,
                 fail_when: Callable[[GenerateRequest], bool] | None = None, fail_imports: bool = False,
                 policy_version: int = 0, on_export: Callable[[str], None] | None = None,
                 before_token: Callable[[GenerateRequest, int], Awaitable[None]] | None = None,
                 script_for: Callable[[GenerateRequest], Callable[[Sequence[int]], int]] | None = None):
        self.name, self.vocab_size, self.capacity, self.max_context = name, vocab_size, capacity, max_context
        self.script, self.fail_when, self.fail_imports, self.on_export = script, fail_when, fail_imports, on_export
        self.before_token, self.script_for = before_token, script_for
        self._version = policy_version
        self._live: dict[str, _FakeStream] = {}
        self.counters: collections.Counter = collections.Counter()

    @property
    def policy_version(self) -> int:
        return self._version

    def submit(self, request: GenerateRequest) -> TokenStream:
        if len(request.prompt_ids) + request.sampling.max_tokens > self.max_context:
            raise ValueError(f"prompt + max_tokens exceeds the context limit of {self.max_context} tokens")
        s = _FakeStream(self, request)
        self._live[request.request_id] = s
        self.counters["submitted"] += 1
        return s

    def forget(self, request_id: str) -> None:
        """A stream that ended is no longer live (called by the stream)."""
        self._live.pop(request_id, None)

    def cancel(self, request_id: str) -> None:
        s = self._live.get(request_id)
        if s is not None:
            s.cancel()

    async def export(self, request_id: str) -> bool:
        s = self._live.get(request_id)
        if s is None or not s.running:
            return False
        s.move()
        self.counters["exported"] += 1
        if self.on_export is not None:
            self.on_export(request_id)
        return True

    def num_active(self) -> int:
        return len(self._live)

    def stats(self) -> dict[str, float]:
        out = {k: float(v) for k, v in self.counters.items()}
        out.setdefault("prefill_tokens", 0.0)
        return out
