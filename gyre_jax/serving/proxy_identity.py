"""Which run, rollout, agent and role a model call belongs to.

Tying a call to a rollout (``identity`` has the names):
  1. Headers ``X-Gyre-Run``, ``X-Gyre-Rollout``, ``X-Gyre-Task``, ``X-Gyre-Group``,
     ``X-Gyre-Agent``, ``X-Gyre-Parent-Agent``, ``X-Gyre-Role``, ``X-Gyre-Call``.
  2. A per-rollout API key, for harnesses that can only set a key (Claude Code:
     ``ANTHROPIC_API_KEY``; OpenAI SDKs: ``OPENAI_API_KEY``), sent as
     ``Authorization: Bearer <key>`` or ``x-api-key: <key>``. Either a secret key
     from ``Proxy.register_rollout(run, rollout, task, group)`` (random: no rollout's
     key can be derived from another's), or, with auth off on a proxy that has
     issued no key, the plain ``gyre:<run>:<rollout>`` form. Once a proxy issues keys,
     an issued key (or the auth token) is the only way to name a rollout.
  Headers win where both are present. Task/group come from headers, else from
  the registration, else "unknown". Agent defaults to 0 and role to "main"; the
  call index to a per-rollout counter when ``X-Gyre-Call`` is absent. With
  ``require_binding`` off (default) an unbound call is served and recorded under
  run ``default_run_id``, rollout ``X-Claude-Code-Session-Id`` or "unbound".
"""
from __future__ import annotations

import dataclasses
import secrets
from typing import Mapping

from gyre_jax.serving import identity as wire
from gyre_jax.serving.api_common import ApiError, bad
from gyre_jax.trajectory.vocab import ROLE_MAIN, ROLE_SUBAGENT, ROLES


@dataclasses.dataclass(frozen=True)
class Binding:
    run_id: str
    rollout_id: str
    task_id: str
    group_id: str
    agent_id: int
    parent_agent_id: int | None
    role: str
    call_index: int | None
    attempt: int


def presented_key(headers: Mapping[str, str]) -> str | None:
    auth = headers.get("Authorization", "")
    if auth.startswith("Bearer "):
        return auth[len("Bearer "):].strip()
    return headers.get("x-api-key")


def authorize(headers: Mapping[str, str], keys: Mapping[str, tuple[str, str]], auth_token: str | None, *,
              issued_only: bool = False):
    """Checks auth; returns the (run, rollout) a key names, if any. Raises ApiError(401).

    ``issued_only``: the proxy has issued secret per-rollout keys, so only those (and the token) are
    credentials. The derivable ``gyre:<run>:<rollout>`` form, bare binding headers and a
    ``X-Claude-Code-Session-Id`` are then refused even with auth off: from inside one rollout's sandbox
    any of them named a peer rollout (its id is guessable from one's own) and recorded calls under it."""
    key = presented_key(headers)
    if key is not None and key in keys:
        return keys[key]
    if auth_token is not None:
        if key is None or not secrets.compare_digest(key, auth_token):
            raise ApiError(401, "missing or wrong API key (Authorization: Bearer ... or x-api-key)",
                           kind="authentication_error")
        return None
    if issued_only:
        raise ApiError(401, "missing, revoked or unknown API key: this proxy issues a secret key per rollout and "
                            "accepts only those (not the gyre:<run>:<rollout> form, nor binding headers alone)",
                       kind="authentication_error")
    if not key:
        return None
    problem = wire.api_key_problem(key)
    if problem is not None:  # meant as a rollout key: serving it as "unbound" would lose the rollout
        raise bad(problem)
    return wire.parse_api_key(key)


def _int_header(h: Mapping[str, str], name: str, default=None):
    v = h.get(name)
    if v is None:
        return default
    try:
        x = int(v)
    except ValueError:
        raise bad(f"header {name}: expected an integer, got {v!r}") from None
    if not 0 <= x < 2**31:
        raise bad(f"header {name}: {x} out of range")
    return x


def resolve_binding(h: Mapping[str, str], keyed: tuple[str, str] | None,
                    registered: Mapping[tuple[str, str], tuple[str, str]], *, require: bool,
                    default_run_id: str) -> Binding:
    """Binding of one request from its headers and the (run, rollout) its key named."""
    run = h.get(wire.HEADER_RUN) or (keyed[0] if keyed else None)
    rollout = h.get(wire.HEADER_ROLLOUT) or (keyed[1] if keyed else None)
    if run is None or rollout is None:
        if require:
            raise bad(f"request is not tied to a rollout: send {wire.HEADER_RUN}/{wire.HEADER_ROLLOUT} headers or a "
                      "rollout API key")
        run = run or default_run_id
        rollout = rollout or h.get("X-Claude-Code-Session-Id") or "unbound"
    known = registered.get((run, rollout))
    task, group = known or ("unknown", "unknown")
    task, group = h.get(wire.HEADER_TASK) or task, h.get(wire.HEADER_GROUP) or group
    if known is not None and (task, group) != known:  # the harness (and the policy's commands) hold its key
        raise bad(f"headers {wire.HEADER_TASK}/{wire.HEADER_GROUP}: rollout {rollout!r} was registered for task "
                  f"{known[0]!r}, group {known[1]!r}, not {task!r}, {group!r}")
    for what, v in (("run", run), ("rollout", rollout), ("task", task), ("group", group)):
        if not (1 <= len(v) <= 256 and v.isprintable() and v.strip() == v):
            raise bad(f"{what} id {v!r} must be 1-256 printable characters without surrounding spaces")
    role = h.get(wire.HEADER_ROLE, ROLE_MAIN)
    if role not in ROLES:
        raise bad(f"header {wire.HEADER_ROLE}: {role!r} is not one of {ROLES}")
    agent, parent = _int_header(h, wire.HEADER_AGENT, 0), _int_header(h, wire.HEADER_PARENT_AGENT)
    if role == ROLE_MAIN and parent is not None:
        raise bad(f"header {wire.HEADER_PARENT_AGENT}: must be absent for role {ROLE_MAIN!r}")
    if role == ROLE_SUBAGENT and parent is None:
        raise bad(f"header {wire.HEADER_PARENT_AGENT}: required for role {ROLE_SUBAGENT!r}")
    if parent is not None and parent == agent:  # the store would refuse the record, after generation
        raise bad(f"header {wire.HEADER_PARENT_AGENT}: {parent} equals {wire.HEADER_AGENT}; an agent is not its "
                  "own parent")
    return Binding(run, rollout, task, group, agent, parent, role, _int_header(h, wire.HEADER_CALL),
                   _int_header(h, wire.HEADER_ATTEMPT, 0))
