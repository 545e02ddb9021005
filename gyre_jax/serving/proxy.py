"""The recording proxy: OpenAI and Anthropic HTTP APIs in front of the router.

Why aiohttp: it is already a dependency (the agents harness uses its client), has
a mature streaming response for SSE, a loopback test client, and needs no ASGI
server; FastAPI + uvicorn would add two dependencies for the same features.

Endpoints: ``POST /v1/chat/completions``, ``POST /v1/completions``,
``POST /v1/messages`` (+ ``/v1/messages/count_tokens``), ``GET /v1/models`` (+ ``/{id}``),
``GET /health``, ``GET /metrics`` (Prometheus text). Every error, on every route
(unknown paths and methods too), is JSON in the API's own format: Anthropic's for
``/v1/messages*`` or a request with an ``anthropic-version`` header, else OpenAI's.

Tying a call to a rollout: headers or a per-rollout API key (proxy_identity).

Recording: each completed call is written exactly once (a ModelCallRecord: the
prompt ids, output ids and behavior log-probs, whichever cells served it) before
the response's last bytes are sent; if the write fails, the call fails (500 or an
error event), so the store never lacks a call a harness saw. A call whose client
went away before the end is not recorded (the harness never saw it and will
retry it). A retry (``X-Gyre-Attempt`` > 0) of a call index this proxy already
recorded is served but not recorded again.

Exact round trips: the ids the model writes are the ids the client sees (both APIs);
ids it did not write are invented in a form the template does not render
(``tokenizer.is_invented_call_id``), so a conversation the client echoes back renders
to the tokens the model produced and every call's prompt extends the previous
prompt + output. ``tool_choice`` forces the tool-call opening (and the name) as
prompt tokens (recorded as prompt: the model did not choose them); text stop
sequences end generation at the token completing them (cut from the reply, the
tokens recorded as generated); ``n`` > 1 prefills the prompt once
(``Router.share_prefill``) and records n calls of the rollout.

Security: binds 127.0.0.1 unless told otherwise; optional bearer token
(``auth_token``); request body size limit (413); ``max_tokens`` cap; malformed
JSON -> 400 naming the position; unknown model -> 404; prompt + max_tokens over
the context -> 400 naming the limit; engine failure -> 500 for that call only;
any other exception is turned into a 500 for that request; a ``gyre:`` API key that
is not ``gyre:<run>:<rollout>`` -> 400 naming it (never served as "unbound");
identity conflicts the store would refuse after generation (a first attempt of a call
number already recorded or in flight, a task or group that changes within a rollout, a
call of a finished rollout) -> 409 before any token (proxy_ledger).
"""
from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import dataclasses
import fnmatch
import hashlib
import json
import logging
import os
import re
import secrets
import threading
import time
import uuid
from typing import Callable

import numpy as np
from aiohttp import web

from gyre_jax.errors import StorageError
from gyre_jax.serving import api_anthropic as A
from gyre_jax.serving import api_openai as O
from gyre_jax.serving.api_common import ApiError, CallIds, ChatCall, OutputText, bad
from gyre_jax.serving.backend import EngineError, GenerateRequest, SamplingParams
from gyre_jax.serving.bound_port import bound_port
from gyre_jax.serving.identity import HEADER_CALL, check_id
from gyre_jax.serving.proxy_identity import Binding, authorize, presented_key, resolve_binding
from gyre_jax.serving.proxy_ledger import CallLedger
from gyre_jax.serving.proxy_stream import Sample, consume, gather_samples, stream_response
from gyre_jax.serving.router import NoCellError, Router
from gyre_jax.serving.tokenizer import Tokenizer
from gyre_jax.trajectory.records import ModelCallRecord, RecordError

log = logging.getLogger(__name__)
ROUTES = ("POST /v1/chat/completions", "POST /v1/completions", "POST /v1/messages", "POST /v1/messages/count_tokens",
          "GET /v1/models", "GET /v1/models/{id}", "GET /health", "GET /metrics")

_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F][0-9a-fA-F]{2}")


@dataclasses.dataclass(frozen=True, kw_only=True)
class ProxyConfig:
    host: str = "127.0.0.1"  # loopback only by default
    port: int = 0  # 0 = any free port (see Proxy.port)
    model_name: str = "gyre"
    model_aliases: tuple[str, ...] = ()  # fnmatch patterns also served, e.g. ("claude-*",) for Claude Code
    auth_token: str | None = None  # if set, every request needs it (or a registered rollout key)
    max_request_bytes: int = 8 << 20
    max_tokens_cap: int = 8192  # per call
    # Reduce a too large max_tokens to what fits (cap, context) instead of 400: for
    # harnesses that ask for a fixed budget (Claude Code asks for 32000).
    clamp_max_tokens: bool = False
    max_concurrent_calls: int = 4096
    require_binding: bool = False
    default_run_id: str = "default"  # for unbound calls when the record sink does not name its run
    # Also serve on this unix socket (mode 0666): a sandboxed harness's only door (its network
    # namespace has no route to the host; see gyre_jax.agents.harnesses.command). None: TCP only.
    unix_path: str | None = None
    # Set: a call that sends no `seed` samples with one derived from (salt, rollout, call index), so
    # the held-out eval (one run id per version) draws the same randomness at every version.
    seed_salt: int | None = None
    # A stream that has sent nothing for this long gets a keep-alive (Anthropic's `ping` event, an SSE
    # comment for OpenAI): a long prompt's prefill can take minutes, and clients give up on a silent stream.
    stream_keepalive_s: float = 10.0

    def __post_init__(self):
        if not self.model_name:
            raise ValueError("ProxyConfig.model_name must be non-empty")
        for f in ("max_request_bytes", "max_tokens_cap", "max_concurrent_calls"):
            if not isinstance(getattr(self, f), int) or getattr(self, f) < 1:
                raise ValueError(f"ProxyConfig.{f} must be a positive int, got {getattr(self, f)!r}")
        if not self.stream_keepalive_s > 0:
            raise ValueError(f"ProxyConfig.stream_keepalive_s must be > 0, got {self.stream_keepalive_s!r}")
        if not 0 <= self.port < 65536:
            raise ValueError(f"ProxyConfig.port={self.port} out of range")
        if self.auth_token is not None and len(self.auth_token) < 8:
            raise ValueError("ProxyConfig.auth_token must be at least 8 characters")
        if self.unix_path is not None and len(self.unix_path.encode()) > 100:
            raise ValueError(f"ProxyConfig.unix_path is over the 100 bytes a unix socket path may have: "
                             f"{self.unix_path!r}")


class Proxy:
    def __init__(self, router: Router, tokenizer: Tokenizer, record_sink, config: ProxyConfig = ProxyConfig()):
        """record_sink: an object with ``append(ModelCallRecord)`` (e.g. a TrajectoryStore)."""
        self.router, self.tok, self.sink, self.cfg = router, tokenizer, record_sink, config
        self.max_context = min(b.max_context for b in router.cells.values())
        self.vocab_size = min(getattr(b, "vocab_size", tokenizer.vocab_size) for b in router.cells.values())
        if tokenizer.vocab_size > self.vocab_size:
            raise ValueError(f"tokenizer has {tokenizer.vocab_size} ids but the model only {self.vocab_size}")
        self._keys: dict[str, tuple[str, str]] = {}  # issued key -> (run, rollout); issue/revoke from any thread
        # Multi-LoRA (gyre_jax/model/lora.py): the adapter a call's rollout samples with, from its binding
        # (the key's rollout and group); None: every call uses the engines' one policy.
        self.adapter_of: Callable[[Binding], int] | None = None
        self._rollouts: dict[tuple[str, str], tuple[str, str]] = {}
        self._keys_lock = threading.Lock()
        self._issuing = False  # set at the first issued key
        self._ledger = CallLedger(record_sink)
        # (run, rollout) -> recorded calls and server-side failures answered to it (usage(); dropped at revoke)
        self._usage: dict[tuple[str, str], collections.Counter] = {}
        self._writer = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="records")  # keeps order
        self.storage_errors: list[BaseException] = []  # record writes our storage refused (the loop stops on them)
        self._inflight = 0
        self.counters: collections.Counter = collections.Counter()
        self._lat: collections.deque = collections.deque(maxlen=4096)
        self._runner: web.AppRunner | None = None
        self._loop: asyncio.AbstractEventLoop | None = None  # the server's (set by start)
        self.port: int | None = None
        self.app = self._make_app()

    # ---- lifecycle -------------------------------------------------------------------
    def _make_app(self) -> web.Application:
        app = web.Application(client_max_size=self.cfg.max_request_bytes, middlewares=[self._guard])
        app.router.add_post("/v1/chat/completions", self._chat)
        app.router.add_post("/v1/completions", self._completions)
        app.router.add_post("/v1/messages", self._messages)
        app.router.add_post("/v1/messages/count_tokens", self._count_tokens)
        app.router.add_get("/v1/models", self._models)
        app.router.add_get("/v1/models/{model_id:.+}", self._model)
        app.router.add_get("/health", self._health)
        app.router.add_get("/metrics", self._metrics)
        return app

    async def start(self) -> str:
        """Serve on config.host:port; returns the base URL (``http://host:port``)."""
        self._loop = asyncio.get_running_loop()
        self._runner = web.AppRunner(self.app, handler_cancellation=True, access_log=None)
        await self._runner.setup()
        site = web.TCPSite(self._runner, self.cfg.host, self.cfg.port)
        await site.start()
        self.port = bound_port(site)
        if self.cfg.unix_path is not None:
            if os.path.exists(self.cfg.unix_path):  # a stale socket of an earlier run
                os.unlink(self.cfg.unix_path)
            await web.UnixSite(self._runner, self.cfg.unix_path).start()
            os.chmod(self.cfg.unix_path, 0o666)  # sandboxed harnesses run as their own uids
        return f"http://{self.cfg.host}:{self.port}"

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
        self._writer.shutdown(wait=True)

    def register_rollout(self, run_id: str, rollout_id: str, task_id: str = "unknown", group_id: str = "unknown") -> str:
        """A fresh secret API key that ties calls to this rollout (thread-safe). With ``auth_token`` set,
        issued keys are the only credentials besides the token: nobody else can put a call into a
        rollout's record."""
        for what, v in (("run id", run_id), ("rollout id", rollout_id), ("task id", task_id), ("group id", group_id)):
            check_id(v, what)
        key = "gk-" + secrets.token_hex(16)
        with self._keys_lock:
            self._issuing = True  # from now on only issued keys (or the token) name a rollout (authorize)
            self._keys[key] = (run_id, rollout_id)
            self._rollouts[(run_id, rollout_id)] = (task_id, group_id)
        return key

    # The rollout runner's KeyIssuer (gyre_jax.agents.harness).
    issue = register_rollout

    def revoke(self, key: str) -> None:
        """The rollout has ended: its key no longer authorizes a call (a call already being served ends
        as it would; the harness's processes are gone by then). What the proxy kept of the rollout
        (its registration, its call ledger entry, its cell affinity) is dropped with its last key: a
        server that runs for weeks of rollouts must not hold every rollout it ever served."""
        with self._keys_lock:
            who = self._keys.pop(key, None)
            if who is None or who in self._keys.values():  # unknown key, or the rollout has another one
                return
            self._rollouts.pop(who, None)
        loop = self._loop
        try:
            running = asyncio.get_running_loop()
        except RuntimeError:
            running = None
        if loop is None or loop is running or loop.is_closed():
            self._forget(who)
            return
        try:  # the ledger and the router live on the server's loop: change them there
            loop.call_soon_threadsafe(self._forget, who)
        except RuntimeError:  # the loop closed since the check (the run is stopping): nothing runs on it any more
            self._forget(who)

    def usage(self, key: str) -> dict[str, int]:
        """What this rollout's calls came to so far: ``calls`` recorded and ``server_errors`` (engine
        or recording failures answered to it). The rollout runner tells from it whether the policy
        had a say in a failed episode (no call: it had none) and whether the model server failed it."""
        with self._keys_lock:
            who = self._keys.get(key)
        counts = self._usage.get(who, collections.Counter()) if who is not None else collections.Counter()
        return {"calls": int(counts["calls"]), "server_errors": int(counts["server_errors"])}

    def held(self) -> dict[str, int]:
        """How many rollouts each per-rollout structure holds now (live keys, registrations, call
        ledger, cell affinities): bounded by the rollouts running, not by those ever served."""
        return {"keys": len(self._keys), "registered": len(self._rollouts), "ledger": len(self._ledger),
                "affinity": self.router.affinity_count()}

    def _count(self, who: tuple[str, str], what: str) -> None:
        if who in self._rollouts:  # issued rollouts only: their entry goes with their last key
            self._usage.setdefault(who, collections.Counter())[what] += 1

    def _forget(self, who: tuple[str, str]) -> None:
        self._ledger.forget(*who)
        self._usage.pop(who, None)
        self.router.forget_affinity(f"{who[0]}/{who[1]}")

    # ---- request plumbing ----------------------------------------------------------------
    @web.middleware
    async def _guard(self, request: web.Request, handler):
        try:
            return await handler(request)
        except web.HTTPException as e:  # routing (404, 405) and aiohttp's own limits (413), in the API's format
            if e.status < 400:
                raise
            return self._error(request, self._http_error(request, e))
        except ApiError as e:
            return self._error(request, e)
        except asyncio.CancelledError:
            raise
        except Exception as e:  # noqa: BLE001 - one bad request must not take the server down
            log.exception("unhandled error on %s", request.path)
            self.counters["internal_errors"] += 1
            return self._error(request, ApiError(500, f"internal error: {type(e).__name__}", kind="api_error"))

    def _http_error(self, request: web.Request, e: web.HTTPException) -> ApiError:
        if e.status == 413:
            return ApiError(413, f"request body over the {self.cfg.max_request_bytes} byte limit",
                            kind="request_too_large")
        if e.status == 404:
            return ApiError(404, f"no route {request.method} {request.path}; this server serves {', '.join(ROUTES)}",
                            kind="not_found_error")
        if e.status == 405:
            allowed = sorted(getattr(e, "allowed_methods", ()) or ())
            return ApiError(405, f"method {request.method} not allowed on {request.path}; allowed: {allowed}",
                            kind="invalid_request_error")
        return ApiError(e.status, f"{e.reason}: {request.method} {request.path}", kind="api_error")

    def _error(self, request: web.Request, e: ApiError) -> web.Response:
        self.counters[f"http_{e.status}"] += 1
        anthropic = request.path.startswith("/v1/messages") or "anthropic-version" in request.headers
        body = A.error_body(e) if anthropic else O.error_body(e)
        return web.json_response(body, status=e.status)

    def _authorize(self, request: web.Request) -> tuple[str, str] | None:
        return authorize(request.headers, self._keys, self.cfg.auth_token, issued_only=self._issuing)

    async def _json(self, request: web.Request) -> dict:
        raw = await request.read()
        try:
            body = json.loads(raw)
        except UnicodeDecodeError as e:
            raise bad(f"request body is not UTF-8: {e}") from None
        except json.JSONDecodeError as e:
            raise bad(f"malformed JSON at line {e.lineno} column {e.colno}: {e.msg}") from None
        except RecursionError:  # a client's problem, not the server's: json.loads recurses per nesting level
            raise bad("request body nests JSON arrays/objects too deeply") from None
        if not isinstance(body, dict):
            raise bad(f"request body must be a JSON object, got {type(body).__name__}")
        if _SURROGATE_ESCAPE.search(raw):  # a \ud8xx escape: fine in a pair, not alone (no tokenizer can encode it)
            try:
                json.dumps(body, ensure_ascii=False).encode("utf-8")
            except UnicodeEncodeError as e:
                raise bad(f"request body holds a lone UTF-16 surrogate ({e.object[e.start:e.end]!a}); "
                          "text must be valid Unicode") from None
        return body

    def _check_model(self, name: str) -> None:
        if name == self.cfg.model_name or any(fnmatch.fnmatchcase(name, p) for p in self.cfg.model_aliases):
            return
        raise ApiError(404, f"model {name!r} not found; this server serves {self.cfg.model_name!r}",
                       kind="not_found_error", param="model")

    def _binding(self, request: web.Request, keyed: tuple[str, str] | None) -> Binding:
        store_run = getattr(self.sink, "run_id", None)  # a TrajectoryStore holds one run
        b = resolve_binding(request.headers, keyed, self._rollouts, require=self.cfg.require_binding,
                            default_run_id=store_run or self.cfg.default_run_id)
        issued = self._keys.get(presented_key(request.headers) or "")
        if issued is not None and (b.run_id, b.rollout_id) != issued:  # a key is good for its own rollout only
            raise ApiError(403, f"this API key was issued for rollout {issued[1]!r} of run {issued[0]!r}, not "
                                f"{b.rollout_id!r} of {b.run_id!r}", kind="permission_error")
        if store_run is not None and b.run_id != store_run:
            raise bad(f"run id {b.run_id!r}: this server records run {store_run!r}")
        return b

    def _sampling(self, call: ChatCall) -> SamplingParams:
        n = int(call.prompt_ids.shape[0])
        room = self.max_context - n
        if room < 1:
            raise bad(f"prompt is {n} tokens; the context limit is {self.max_context} tokens (prompt + max_tokens)",
                      "messages")
        mt = call.max_tokens
        if mt is None or self.cfg.clamp_max_tokens:
            mt = min(room, self.cfg.max_tokens_cap, mt or room)
        if mt > self.cfg.max_tokens_cap:
            raise bad(f"max_tokens: {mt} exceeds this server's cap of {self.cfg.max_tokens_cap}", "max_tokens")
        if n + mt > self.max_context:
            raise bad(f"prompt ({n} tokens) + max_tokens ({mt}) exceeds the context limit of {self.max_context} "
                      "tokens", "max_tokens")
        seed = call.seed if call.seed is not None else secrets.randbelow(2**31)
        return SamplingParams(max_tokens=mt, temperature=call.temperature, top_p=call.top_p, seed=seed,
                              stop_ids=call.stop_ids)

    # ---- the model-call endpoints ------------------------------------------------------
    async def _chat(self, request):
        return await self._serve(request, "openai.chat")

    async def _completions(self, request):
        return await self._serve(request, "openai.completions")

    async def _messages(self, request):
        return await self._serve(request, "anthropic.messages")

    async def _serve(self, request: web.Request, api: str) -> web.StreamResponse:
        t0 = time.time()
        self.counters[f"requests{{api={api}}}"] += 1
        keyed = self._authorize(request)
        body = await self._json(request)
        if api == "openai.chat":
            call = O.parse_chat(body, self.tok)
        elif api == "openai.completions":
            call = O.parse_completion(body, self.tok, self.vocab_size)
        else:
            call = A.parse_messages(body, self.tok)
        self._check_model(call.model)
        binding = self._binding(request, keyed)
        sampling = self._sampling(call)
        if self.adapter_of is not None:  # the rollout's adapter, routed by its key
            sampling = dataclasses.replace(sampling, adapter=self.adapter_of(binding))
        if self._inflight + call.n > self.cfg.max_concurrent_calls:
            raise ApiError(503, f"over {self.cfg.max_concurrent_calls} concurrent calls; retry later", kind="overloaded_error")
        if call.n > 1 and binding.call_index is not None:
            raise bad(f"n: {call.n} samples are {call.n} calls of the rollout, numbered by the proxy; do not send "
                      f"{HEADER_CALL} with n > 1", "n")
        # numbered (the next n of the rollout if it named none, continuing what the store holds
        # after a restart) and checked against the rollout's calls: a conflict is a 409 now,
        # before any token is generated, not a record the store refuses afterwards
        binding = self._ledger.claim(binding, call.n)
        if self.cfg.seed_salt is not None and call.seed is None:
            digest = hashlib.sha256(f"{self.cfg.seed_salt}/{binding.rollout_id}/{binding.call_index}".encode()).digest()
            sampling = dataclasses.replace(sampling, seed=int.from_bytes(digest[:4], "little") % 2**31)
        affinity = f"{binding.run_id}/{binding.rollout_id}"
        reqs = [GenerateRequest(request_id=uuid.uuid4().hex, prompt_ids=call.prompt_ids,
                                sampling=dataclasses.replace(sampling, seed=(sampling.seed + i) % 2**31),
                                cache_key=f"{binding.run_id}/{binding.rollout_id}/{binding.agent_id}")
                for i in range(call.n)]
        self._inflight += call.n
        self.counters["prompt_tokens"] += int(call.prompt_ids.shape[0]) * call.n
        try:
            if call.n > 1:  # the prompt is prefilled once; the samples (same affinity, same cell) reuse its KV
                await self.router.share_prefill(reqs[0], affinity=affinity)
            routed = [self.router.start(r, affinity=affinity) for r in reqs]
            if call.stream:
                return await stream_response(self, request, call, routed, binding, t0)
            return await self._whole(call, routed, binding, t0)
        except (EngineError, NoCellError) as e:
            self.counters["engine_errors"] += 1
            self._count((binding.run_id, binding.rollout_id), "server_errors")
            status = 503 if isinstance(e, NoCellError) else 500
            raise ApiError(status, f"engine error: {e}", kind="api_error") from None
        except RecordError as e:
            self._count((binding.run_id, binding.rollout_id), "server_errors")
            raise ApiError(500, f"the call could not be recorded: {e}", kind="api_error") from None
        except ValueError as e:  # the backend refused the request
            raise bad(str(e)) from None
        except asyncio.CancelledError:  # the client went away (counted once: the stream does not count this)
            self.counters["calls_unrecorded_client_gone"] += 1
            raise
        finally:
            self._inflight -= call.n
            self._ledger.release(binding, call.n)

    def reply_headers(self, call: ChatCall) -> dict[str, str]:
        return {"X-Gyre-Ignored-Fields": ",".join(call.ignored)} if call.ignored else {}

    def output(self, call: ChatCall, routed) -> OutputText:
        """What the client sees of one sample (tool-call ids, stop sequences applied)."""
        prefix = "toolu" if call.api.startswith("anthropic") else "call"
        return OutputText(self.tok, call, CallIds(self.tok, routed.request_id, prefix))

    async def _whole(self, call, routed, binding, t0) -> web.Response:
        async def one(i, r) -> Sample:
            out = self.output(call, r)
            sample = await consume(r, out)
            await self.record_call(call, r, dataclasses.replace(binding, call_index=binding.call_index + i), t0, sample)
            return sample

        samples = await gather_samples(one(i, r) for i, r in enumerate(routed))
        rid = f"{'msg' if call.api.startswith('anthropic') else 'gyre'}-{routed[0].request_id}"
        if call.api == "openai.chat":
            body = O.chat_response(call, self.tok, rid, samples)
        elif call.api == "openai.completions":
            body = O.completion_response(call, self.tok, rid, samples)
        else:
            body = A.message_response(call, self.tok, rid, samples[0])
        return web.json_response(body, headers=self.reply_headers(call))

    async def record_call(self, call: ChatCall, routed, binding: Binding, t0: float, sample: Sample) -> None:
        """Write the call's record once; raises (the call then fails) if the store refuses it."""
        if binding.call_index is None:  # the ledger numbers every call before it is routed
            raise RuntimeError(f"proxy: call of rollout {binding.rollout_id!r} reached its record with no call index")
        key = (binding.run_id, binding.rollout_id, binding.call_index)
        if binding.attempt > 0 and self._ledger.is_recorded(*key):
            self.counters["retry_already_recorded"] += 1
            return
        fin = "tool_calls" if sample.finish == "stop" and sample.calls else sample.finish
        rec = ModelCallRecord(
            run_id=binding.run_id, rollout_id=binding.rollout_id, task_id=binding.task_id, group_id=binding.group_id,
            agent_id=binding.agent_id, parent_agent_id=binding.parent_agent_id, role=binding.role,
            call_index=binding.call_index, prompt_ids=call.prompt_ids, output_ids=np.asarray(sample.tokens, np.int32),
            output_logprobs=np.asarray(sample.logprobs, np.float32), output_routing=sample.routing_array(),
            policy_version=int(routed.policy_version or 0),
            t_start=t0, t_end=max(t0, time.time()), finish_reason=fin if fin in ("stop", "length", "tool_calls") else "abort")
        fut = asyncio.get_running_loop().run_in_executor(self._writer, self.sink.append, rec)
        try:
            await asyncio.shield(fut)
        except RecordError:
            self.counters["record_errors"] += 1
            raise
        except StorageError as e:  # our disk, not the harness's call: the run that owns the store stops on it
            self.counters["storage_errors"] += 1
            self.storage_errors.append(e)
            self._count(key[:2], "server_errors")
            raise ApiError(503, f"the call could not be recorded: {e}; the run is stopping", kind="api_error") from None
        self._ledger.recorded(*key)
        self._count(key[:2], "calls")
        self.counters["records_written"] += 1
        self.counters["completion_tokens"] += len(sample.tokens)
        self.counters["moves_kv"] += routed.moves_kv
        self._lat.append(time.time() - t0)

    # ---- small endpoints ---------------------------------------------------------------
    async def _count_tokens(self, request):
        self._authorize(request)
        return web.json_response(A.count_tokens(await self._json(request), self.tok))

    @staticmethod
    def _model_object(m: str) -> dict:  # the fields of both APIs' model objects
        return {"id": m, "object": "model", "type": "model", "owned_by": "gyre", "display_name": m, "created": 0,
                "created_at": "1970-01-01T00:00:00Z"}

    async def _models(self, request):
        self._authorize(request)
        m = self.cfg.model_name
        return web.json_response({"object": "list", "data": [self._model_object(m)],
                                  "has_more": False, "first_id": m, "last_id": m})

    async def _model(self, request):
        """``GET /v1/models/{id}`` (openai ``models.retrieve``, anthropic ``models.retrieve``)."""
        self._authorize(request)
        name = request.match_info["model_id"]
        self._check_model(name)
        return web.json_response(self._model_object(name))

    async def _health(self, request):
        """Liveness for anyone; the cells and load only with a credential when auth is on."""
        try:
            self._authorize(request)
        except ApiError:
            return web.json_response({"status": "ok"})
        return web.json_response({"status": "ok", "cells": {n: n in self.router.admitting() for n in self.router.cells},
                                  "inflight": self._inflight})

    async def _metrics(self, request):
        self._authorize(request)  # with auth on, the token (or a live rollout key)
        lines = []

        def put(name, value):  # "name{k=v,k2=v2}" -> Prometheus text with quoted label values
            base, _, labels = name.partition("{")
            pairs = [p.split("=", 1) for p in labels.rstrip("}").split(",") if "=" in p]
            lab = ",".join(f'{k}="{v}"' for k, v in pairs)
            lines.append(f"gyre_{base}{'{' + lab + '}' if lab else ''} {value}")

        for k, v in sorted(self.counters.items()):
            put(k, v)
        put("inflight_calls", self._inflight)
        if self._lat:
            lat = np.asarray(self._lat)
            put("call_latency_seconds{quantile=0.5}", float(np.percentile(lat, 50)))
            put("call_latency_seconds{quantile=0.99}", float(np.percentile(lat, 99)))
        for k, v in sorted(self.router.stats().items()):
            put(f"router_{k}", v)
        for name, b in sorted(self.router.cells.items()):
            for k, v in sorted(b.stats().items()):
                put(f"cell_{k}{{cell={name}}}", v)
        return web.Response(text="\n".join(lines) + "\n", content_type="text/plain")
