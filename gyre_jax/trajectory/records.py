"""Token-in, token-out records: one per model call, one outcome per rollout.

``ModelCallRecord`` holds the exact token ids fed to the model (``prompt_ids``)
and the ids it produced (``output_ids``) with one behavior log-prob per output
token. ``RolloutOutcome`` closes a rollout: status, partial-credit score, grader
details. Both are frozen, ``kw_only`` dataclasses that validate in
``__post_init__``; a bad record raises ``RecordError`` naming the record
(rollout id, call index) and the field. Token arrays are copied once on ingest
and made read-only, so a record really is immutable.

Ids. ``run_id``, ``rollout_id``, ``task_id`` and ``group_id`` are strings (the
proxy gets session ids such as UUIDs from harnesses; task ids are names):
1..256 printable characters, no surrounding whitespace. ``agent_id``,
``parent_agent_id``, ``call_index`` and ``policy_version`` are ints in
[0, 2**31). ``call_index`` is unique within a rollout across all its agents (the
store enforces that); it orders calls and names them in ``TreeNode.call_ids``.

Two encodings:

* ``to_bytes`` / ``from_bytes`` (what the store writes): a u32 length, a small
  UTF-8 JSON header padded to 4 bytes, then the raw little-endian arrays
  (prompt int32, output int32, logprobs float32, then an MoE model's routing:
  uint8 or uint16 [output, R], padded to 4 bytes). 4 bytes per prompt token and
  8 per output token (+ R or 2R routing bytes), and decoding is ``np.frombuffer`` (zero-copy, no Python
  object per token). Paper-scale rollouts record ~20M prompt tokens, so per-token
  Python parsing (decimal JSON lists: ~6 bytes and one int object per token) or
  zlib (CPU on the proxy's hot path, and random-looking ids barely compress
  within one record; the real redundancy is *across* calls, which is what the
  tree rebuild exploits) would both cost more than they save.
* ``to_dict`` / ``to_json`` (quarantine file, debugging, HTTP): the same header
  fields with the arrays as base64 of the same little-endian bytes (5.3 bytes per
  token, still decoded by ``np.frombuffer``), so a quarantined record stays
  human-greppable and can be re-ingested after a fix.
"""
from __future__ import annotations

import base64
import dataclasses
import json
import math
import struct
from typing import Any, Mapping

import numpy as np

from gyre_jax.trajectory.vocab import ROLE_MAIN, ROLE_SUBAGENT, ROLES, SCORED_STATUSES, STATUSES

# The proxy maps engine/API stop reasons onto these (OpenAI "stop"/"length"/
# "tool_calls"; Anthropic end_turn/stop_sequence -> stop, max_tokens -> length,
# tool_use -> tool_calls); "abort" is a call cut off by a deadline or drain.
FINISH_REASONS = ("stop", "length", "tool_calls", "abort")
MAX_ID = 2**31 - 1
MAX_STR_ID = 256
FORMAT_VERSION = 1
_LE_I32 = np.dtype("<i4")
_LE_F32 = np.dtype("<f4")
# Routing replay: the experts an MoE engine chose for each output token, R = MoE layers x top-k
# ids per token (Qwen3-30B-A3B: 48 x 8 = 384), one byte each up to 256 experts, else two.
# Records written before this field (no "routing" in the header) read back with None.
ROUTING_DTYPES: dict[str, np.dtype] = {"u1": np.dtype("u1"), "u2": np.dtype("<u2")}
MAX_ROUTING_WIDTH = 1 << 14  # ids per token: bounds a record's routing bytes at 32 KiB per output token


class RecordError(ValueError):
    """A record failed validation. ``where`` names the record, ``field`` the field."""

    def __init__(self, where: str, field: str, message: str):
        self.where = where
        self.field = field
        self.message = message
        super().__init__(f"{where}.{field}: {message}")


def _where_call(rollout_id, call_index) -> str:
    return f"ModelCallRecord(rollout_id={rollout_id!r}, call_index={call_index!r})"


def _where_outcome(rollout_id) -> str:
    return f"RolloutOutcome(rollout_id={rollout_id!r})"


def _check_str_id(where, field, value) -> str:
    if not isinstance(value, str):
        raise RecordError(where, field, f"must be a str, got {type(value).__name__}")
    if not 1 <= len(value) <= MAX_STR_ID:
        raise RecordError(where, field, f"length {len(value)} not in [1, {MAX_STR_ID}]")
    if not value.isprintable() or value.strip() != value:
        raise RecordError(where, field, f"{value!r} has non-printable characters or surrounding whitespace")
    return value


def _check_int(where, field, value, *, lo=0, hi=MAX_ID) -> int:
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)):
        raise RecordError(where, field, f"must be an int, got {type(value).__name__}")
    value = int(value)
    if not lo <= value <= hi:
        raise RecordError(where, field, f"{value} not in [{lo}, {hi}]")
    return value


def _check_time(where, field, value) -> float:
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, float, np.integer, np.floating)):
        raise RecordError(where, field, f"must be a number (unix seconds), got {type(value).__name__}")
    value = float(value)
    if not math.isfinite(value) or value < 0:
        raise RecordError(where, field, f"{value} must be finite and >= 0")
    return value


def _frozen_array(arr: np.ndarray, dtype) -> np.ndarray:
    # Read-only arrays of the right dtype (e.g. from np.frombuffer over the
    # store's bytes) are kept as they are; anything else is copied once.
    if arr.dtype == dtype and not arr.flags.writeable and arr.flags.c_contiguous:
        return arr
    out = np.array(arr, dtype=dtype, copy=True)
    out.flags.writeable = False
    return out


def _check_tokens(where, field, value, *, min_len) -> np.ndarray:
    try:
        arr = np.asarray(value)
    except Exception as e:  # ragged lists and the like
        raise RecordError(where, field, f"not convertible to an array: {e}") from None
    if arr.ndim != 1:
        raise RecordError(where, field, f"must be 1-D, got shape {arr.shape}")
    if arr.shape[0] == 0:
        arr = arr.astype(np.int32)  # np.asarray([]) is float64
    if arr.dtype.kind not in "iu":
        raise RecordError(where, field, f"token ids must be integers, got dtype {arr.dtype}")
    if arr.shape[0] < min_len:
        raise RecordError(where, field, f"needs at least {min_len} token(s), got {arr.shape[0]}")
    if arr.shape[0]:
        lo, hi = int(arr.min()), int(arr.max())
        if lo < 0 or hi > MAX_ID:
            bad = int(np.flatnonzero((arr < 0) | (arr > MAX_ID))[0])
            raise RecordError(where, field, f"token id {int(arr[bad])} at index {bad} not in [0, {MAX_ID}]")
    return _frozen_array(arr, np.int32)


def _check_routing(where, field, value, n):
    """None, or uint8/uint16 [n, R] expert ids (other integer dtypes are converted after a range check)."""
    if value is None:
        return None
    try:
        arr = np.asarray(value)
    except Exception as e:
        raise RecordError(where, field, f"not convertible to an array: {e}") from None
    if arr.ndim != 2 or arr.shape[0] != n or not 1 <= arr.shape[1] <= MAX_ROUTING_WIDTH:
        raise RecordError(where, field, f"must be [output tokens = {n}, R] with 1 <= R <= {MAX_ROUTING_WIDTH}, "
                                        f"got shape {arr.shape}")
    if arr.dtype.kind not in "iu":
        raise RecordError(where, field, f"expert ids must be integers, got dtype {arr.dtype}")
    if arr.dtype not in (np.uint8, np.uint16):
        if arr.size and (int(arr.min()) < 0 or int(arr.max()) > 0xFFFF):
            raise RecordError(where, field, f"expert ids must be in [0, 65535], got [{int(arr.min())}, {int(arr.max())}]")
        arr = arr.astype(np.uint16)
    return _frozen_array(arr, arr.dtype)


def _routing_code(arr: np.ndarray) -> str:
    return "u1" if arr.dtype.itemsize == 1 else "u2"


def _check_logprobs(where, field, value, n) -> np.ndarray:
    try:
        arr = np.asarray(value)
    except Exception as e:
        raise RecordError(where, field, f"not convertible to an array: {e}") from None
    if arr.ndim != 1:
        raise RecordError(where, field, f"must be 1-D, got shape {arr.shape}")
    if arr.shape[0] == 0:
        arr = arr.astype(np.float32)
    if arr.dtype.kind not in "fiu":
        raise RecordError(where, field, f"must be real numbers, got dtype {arr.dtype}")
    if arr.shape[0] != n:
        raise RecordError(where, field, f"has {arr.shape[0]} entries but output_ids has {n}; need one per output token")
    arr = _frozen_array(arr, np.float32)
    bad = ~np.isfinite(arr) | (arr > 0)
    if bad.any():
        k = int(np.flatnonzero(bad)[0])
        raise RecordError(where, field, f"log-prob {float(arr[k])} at index {k} must be finite and <= 0")
    return arr


@dataclasses.dataclass(frozen=True, kw_only=True, eq=False)
class ModelCallRecord:
    """One model call, exactly as the engine saw it (token-in, token-out)."""

    run_id: str
    rollout_id: str
    task_id: str
    group_id: str
    agent_id: int
    parent_agent_id: int | None  # None for the main agent
    role: str  # one of ROLES
    call_index: int  # unique within the rollout, across agents
    prompt_ids: np.ndarray  # int32[P], P >= 1: exact tokens fed to the model
    output_ids: np.ndarray  # int32[O]
    output_logprobs: np.ndarray  # float32[O], behavior log-prob of each output token
    policy_version: int
    t_start: float  # unix seconds
    t_end: float
    finish_reason: str  # one of FINISH_REASONS
    # MoE engines: uint8/uint16 [O, R] experts chosen at the step that sampled each output token
    # (routing replay; R = MoE layers x top-k, layer-major). None: not recorded (dense model).
    output_routing: np.ndarray | None = None

    def __post_init__(self):
        w = _where_call(self.rollout_id, self.call_index)
        s = lambda k, v: object.__setattr__(self, k, v)  # noqa: E731 (frozen dataclass)
        for f in ("run_id", "rollout_id", "task_id", "group_id"):
            s(f, _check_str_id(w, f, getattr(self, f)))
        s("call_index", _check_int(w, "call_index", self.call_index))
        w = _where_call(self.rollout_id, self.call_index)
        s("agent_id", _check_int(w, "agent_id", self.agent_id))
        s("policy_version", _check_int(w, "policy_version", self.policy_version))
        if self.role not in ROLES:
            raise RecordError(w, "role", f"unknown role {self.role!r}; known: {ROLES}")
        if self.parent_agent_id is not None:
            s("parent_agent_id", _check_int(w, "parent_agent_id", self.parent_agent_id))
        if self.role == ROLE_MAIN and self.parent_agent_id is not None:
            raise RecordError(w, "parent_agent_id", f"must be None for role 'main', got {self.parent_agent_id}")
        if self.role == ROLE_SUBAGENT and self.parent_agent_id is None:
            raise RecordError(w, "parent_agent_id", "a 'subagent' call needs its parent agent's id")
        if self.parent_agent_id is not None and self.parent_agent_id == self.agent_id:
            raise RecordError(w, "parent_agent_id", f"equals agent_id {self.agent_id}; an agent is not its own parent")
        s("prompt_ids", _check_tokens(w, "prompt_ids", self.prompt_ids, min_len=1))
        s("output_ids", _check_tokens(w, "output_ids", self.output_ids, min_len=0))
        s("output_logprobs", _check_logprobs(w, "output_logprobs", self.output_logprobs, self.output_ids.shape[0]))
        s("output_routing", _check_routing(w, "output_routing", self.output_routing, self.output_ids.shape[0]))
        s("t_start", _check_time(w, "t_start", self.t_start))
        s("t_end", _check_time(w, "t_end", self.t_end))
        if self.t_end < self.t_start:
            raise RecordError(w, "t_end", f"{self.t_end} is before t_start {self.t_start}")
        if self.finish_reason not in FINISH_REASONS:
            raise RecordError(w, "finish_reason", f"unknown finish reason {self.finish_reason!r}; known: {FINISH_REASONS}")

    @property
    def where(self) -> str:
        return _where_call(self.rollout_id, self.call_index)

    @property
    def sequence(self) -> np.ndarray:
        """prompt_ids + output_ids: the path this call adds to the rollout's tree."""
        return np.concatenate([self.prompt_ids, self.output_ids])

    def _header(self) -> dict[str, Any]:
        return {
            "kind": "call", "v": FORMAT_VERSION, "run_id": self.run_id, "rollout_id": self.rollout_id,
            "task_id": self.task_id, "group_id": self.group_id, "agent_id": self.agent_id,
            "parent_agent_id": self.parent_agent_id, "role": self.role, "call_index": self.call_index,
            "policy_version": self.policy_version, "t_start": self.t_start, "t_end": self.t_end,
            "finish_reason": self.finish_reason,
            "n_prompt": int(self.prompt_ids.shape[0]), "n_output": int(self.output_ids.shape[0]),
            **({} if self.output_routing is None else
               {"routing": [int(self.output_routing.shape[1]), _routing_code(self.output_routing)]}),
        }

    def to_parts(self) -> tuple[dict[str, Any], list]:
        """(header, buffers) whose concatenation is ``to_bytes()``; the arrays are not copied."""
        h = self._header()
        head = json.dumps(h, separators=(",", ":")).encode()
        head += b" " * (-len(head) % 4)  # keep the arrays 4-byte aligned
        parts = [
            struct.pack("<I", len(head)) + head,
            self.prompt_ids.astype(_LE_I32, copy=False).data.cast("B"),
            self.output_ids.astype(_LE_I32, copy=False).data.cast("B"),
            self.output_logprobs.astype(_LE_F32, copy=False).data.cast("B"),
        ]
        if self.output_routing is not None:
            r = self.output_routing.astype(ROUTING_DTYPES[_routing_code(self.output_routing)], copy=False)
            parts.append(r.tobytes() + b"\0" * (-r.nbytes % 4))  # the next frame stays 4-byte aligned
        return h, parts

    def to_bytes(self) -> bytes:
        return b"".join(self.to_parts()[1])

    def to_dict(self) -> dict[str, Any]:
        d = self._header()
        d["prompt_ids"] = _b64(self.prompt_ids, _LE_I32)
        d["output_ids"] = _b64(self.output_ids, _LE_I32)
        d["output_logprobs"] = _b64(self.output_logprobs, _LE_F32)
        if self.output_routing is not None:
            d["output_routing"] = _b64(self.output_routing, ROUTING_DTYPES[_routing_code(self.output_routing)])
        return d

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), separators=(",", ":"))


@dataclasses.dataclass(frozen=True, kw_only=True, eq=False)
class RolloutOutcome:
    """How a rollout ended. ``score`` is None exactly for infra/verifier failures."""

    run_id: str
    rollout_id: str
    task_id: str
    group_id: str
    status: str  # one of STATUSES
    score: float | None  # in [0, 1] (partial credit) for completed/timeout; None for failures
    details: dict = dataclasses.field(default_factory=dict)  # grader output, JSON-serializable
    policy_versions: tuple[int, ...] = ()  # policy versions that produced this rollout's calls
    t_end: float = 0.0  # unix seconds
    num_calls: int | None = None  # call records the proxy wrote for it, if known (completeness check)

    def __post_init__(self):
        w = _where_outcome(self.rollout_id)
        s = lambda k, v: object.__setattr__(self, k, v)  # noqa: E731
        for f in ("run_id", "rollout_id", "task_id", "group_id"):
            s(f, _check_str_id(w, f, getattr(self, f)))
        w = _where_outcome(self.rollout_id)
        if self.status not in STATUSES:
            raise RecordError(w, "status", f"unknown status {self.status!r}; known: {STATUSES}")
        if self.status in SCORED_STATUSES:
            if self.score is None:
                raise RecordError(w, "score", f"status {self.status!r} needs a score in [0, 1] (a timeout is graded for partial credit)")
            if isinstance(self.score, (bool, np.bool_)) or not isinstance(self.score, (int, float, np.integer, np.floating)):
                raise RecordError(w, "score", f"must be a number, got {type(self.score).__name__}")
            score = float(self.score)
            if not (math.isfinite(score) and 0.0 <= score <= 1.0):
                raise RecordError(w, "score", f"{score} not in [0, 1]")
            s("score", score)
        elif self.score is not None:
            raise RecordError(w, "score", f"must be None for status {self.status!r}: a failed rollout has no score (never train it as 0), got {self.score!r}")
        if not isinstance(self.details, Mapping):
            raise RecordError(w, "details", f"must be a dict, got {type(self.details).__name__}")
        try:  # a private, JSON-clean copy: later mutation by the caller cannot change it
            s("details", json.loads(json.dumps(dict(self.details), allow_nan=False)))
        except (TypeError, ValueError) as e:
            raise RecordError(w, "details", f"must be JSON-serializable: {e}") from None
        if isinstance(self.policy_versions, (str, bytes)) or not hasattr(self.policy_versions, "__iter__"):
            raise RecordError(w, "policy_versions", f"must be a sequence of ints, got {type(self.policy_versions).__name__}")
        s("policy_versions", tuple(_check_int(w, "policy_versions", v) for v in self.policy_versions))
        s("t_end", _check_time(w, "t_end", self.t_end))
        if self.num_calls is not None:
            s("num_calls", _check_int(w, "num_calls", self.num_calls))

    @property
    def where(self) -> str:
        return _where_outcome(self.rollout_id)

    @property
    def is_failure(self) -> bool:
        """Infra/verifier failure: no training signal, not in group statistics."""
        return self.status not in SCORED_STATUSES

    def to_dict(self) -> dict[str, Any]:
        return {
            "kind": "outcome", "v": FORMAT_VERSION, "run_id": self.run_id, "rollout_id": self.rollout_id,
            "task_id": self.task_id, "group_id": self.group_id, "status": self.status, "score": self.score,
            "details": self.details, "policy_versions": list(self.policy_versions), "t_end": self.t_end,
            "num_calls": self.num_calls,
        }

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), separators=(",", ":"))

    def to_parts(self) -> tuple[dict[str, Any], list]:
        h = self.to_dict()
        head = json.dumps(h, separators=(",", ":")).encode()
        head += b" " * (-len(head) % 4)
        return h, [struct.pack("<I", len(head)) + head]

    def to_bytes(self) -> bytes:
        return b"".join(self.to_parts()[1])


Record = ModelCallRecord | RolloutOutcome
_CALL_FIELDS = tuple(f.name for f in dataclasses.fields(ModelCallRecord))
_OUTCOME_FIELDS = tuple(f.name for f in dataclasses.fields(RolloutOutcome))


def _b64(arr: np.ndarray, dtype) -> str:
    return base64.b64encode(arr.astype(dtype, copy=False).tobytes()).decode("ascii")


def _unb64(where, field, value, dtype) -> np.ndarray:
    if isinstance(value, (list, tuple)):  # plain JSON lists are accepted too
        return np.asarray(value)
    if not isinstance(value, str):
        raise RecordError(where, field, f"must be base64 of little-endian {dtype} or a list, got {type(value).__name__}")
    try:
        raw = base64.b64decode(value, validate=True)
    except ValueError as e:
        raise RecordError(where, field, f"bad base64: {e}") from None
    if len(raw) % dtype.itemsize:
        raise RecordError(where, field, f"{len(raw)} bytes is not a whole number of {dtype} values")
    return np.frombuffer(raw, dtype=dtype)


def _from_header(d: Mapping[str, Any], arrays: Mapping[str, np.ndarray] | None) -> Record:
    if not isinstance(d, Mapping):
        raise RecordError("record", "kind", f"expected a JSON object, got {type(d).__name__}")
    kind = d.get("kind")
    cls: type[Record]
    if kind == "call":
        where = _where_call(d.get("rollout_id"), d.get("call_index"))
        fields, cls = _CALL_FIELDS, ModelCallRecord
    elif kind == "outcome":
        where = _where_outcome(d.get("rollout_id"))
        fields, cls = _OUTCOME_FIELDS, RolloutOutcome
    else:
        raise RecordError(f"record(rollout_id={d.get('rollout_id')!r})", "kind", f"must be 'call' or 'outcome', got {kind!r}")
    if d.get("v", FORMAT_VERSION) != FORMAT_VERSION:
        raise RecordError(where, "v", f"format version {d.get('v')!r}, this code reads {FORMAT_VERSION}")
    kw: dict[str, Any] = {}
    for f in fields:
        if arrays is not None and f in arrays:
            kw[f] = arrays[f]
        elif f in d:
            kw[f] = d[f]
        elif kind == "outcome" and f in ("details", "policy_versions", "t_end", "num_calls"):
            continue  # defaults
        elif kind == "call" and f == "output_routing":
            continue  # a dense model's record (or one written before routing was recorded)
        else:
            raise RecordError(where, f, "missing")
    unknown = set(d) - set(fields) - {"kind", "v", "n_prompt", "n_output", "routing"}
    if unknown:
        raise RecordError(where, sorted(unknown)[0], f"unknown field(s) {sorted(unknown)}")
    if kind == "outcome" and isinstance(kw.get("policy_versions"), list):
        kw["policy_versions"] = tuple(kw["policy_versions"])
    return cls(**kw)


def record_from_dict(d: Mapping[str, Any]) -> Record:
    """Inverse of ``to_dict`` (arrays as base64 or plain lists). Raises RecordError."""
    if isinstance(d, Mapping) and d.get("kind") == "call":
        where = _where_call(d.get("rollout_id"), d.get("call_index"))
        arrays = {}
        for f, dt in (("prompt_ids", _LE_I32), ("output_ids", _LE_I32), ("output_logprobs", _LE_F32)):
            if f not in d:
                raise RecordError(where, f, "missing")
            arrays[f] = _unb64(where, f, d[f], dt)
        if d.get("output_routing") is not None:
            width, code = _routing_header(where, d)
            flat = _unb64(where, "output_routing", d["output_routing"], ROUTING_DTYPES[code])
            if flat.size % width:
                raise RecordError(where, "output_routing", f"{flat.size} ids is not a whole number of rows of {width}")
            arrays["output_routing"] = flat.reshape(-1, width)
        return _from_header(d, arrays)
    return _from_header(d, None)


def _routing_header(where, d) -> tuple[int, str]:
    r = d.get("routing")
    if not (isinstance(r, list) and len(r) == 2 and isinstance(r[0], int) and 1 <= r[0] <= MAX_ROUTING_WIDTH
            and r[1] in ROUTING_DTYPES):
        raise RecordError(where, "routing", f"must be [R in 1..{MAX_ROUTING_WIDTH}, one of {sorted(ROUTING_DTYPES)}], "
                                            f"got {r!r}")
    return r[0], r[1]


def record_from_json(text: str | bytes) -> Record:
    try:
        d = json.loads(text)
    except ValueError as e:
        raise RecordError("record", "json", f"not valid JSON: {e}") from None
    return record_from_dict(d)


def record_from_bytes(payload: bytes) -> Record:
    """Inverse of ``to_bytes``. Token arrays are read-only views of ``payload``."""
    if len(payload) < 4:
        raise RecordError("record", "payload", f"{len(payload)} bytes is too short")
    (hlen,) = struct.unpack_from("<I", payload, 0)
    if 4 + hlen > len(payload):
        raise RecordError("record", "payload", f"header length {hlen} exceeds payload of {len(payload)} bytes")
    try:
        d = json.loads(payload[4 : 4 + hlen])
    except ValueError as e:
        raise RecordError("record", "header", f"not valid JSON: {e}") from None
    if not isinstance(d, dict):
        raise RecordError("record", "header", f"expected a JSON object, got {type(d).__name__}")
    if d.get("kind") != "call":
        if 4 + hlen != len(payload):
            raise RecordError(_where_outcome(d.get("rollout_id")), "payload", f"{len(payload) - 4 - hlen} trailing bytes")
        return _from_header(d, None)
    where = _where_call(d.get("rollout_id"), d.get("call_index"))
    n_p, n_o = d.get("n_prompt"), d.get("n_output")
    if not (isinstance(n_p, int) and isinstance(n_o, int) and n_p >= 0 and n_o >= 0):
        raise RecordError(where, "n_prompt", f"bad array lengths n_prompt={n_p!r} n_output={n_o!r}")
    off = 4 + hlen
    routed = "routing" in d
    width, code = _routing_header(where, d) if routed else (0, "u1")
    r_bytes = n_o * width * ROUTING_DTYPES[code].itemsize
    need = off + 4 * (n_p + 2 * n_o) + r_bytes + (-r_bytes % 4)
    if need != len(payload):
        raise RecordError(where, "payload", f"{len(payload)} bytes, header says {need}")
    buf = memoryview(payload)
    arrays = {
        "prompt_ids": np.frombuffer(buf, _LE_I32, n_p, off),
        "output_ids": np.frombuffer(buf, _LE_I32, n_o, off + 4 * n_p),
        "output_logprobs": np.frombuffer(buf, _LE_F32, n_o, off + 4 * (n_p + n_o)),
    }
    if routed:
        arrays["output_routing"] = np.frombuffer(buf, ROUTING_DTYPES[code], n_o * width,
                                                 off + 4 * (n_p + 2 * n_o)).reshape(n_o, width)
    return _from_header(d, arrays)
