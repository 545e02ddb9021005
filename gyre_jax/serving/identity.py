"""The wire convention that ties every model call to a run, rollout and agent.

The proxy (``proxy_identity``) reads exactly these names; any harness that sends them
(or only the API key) gets its calls recorded under the right rollout. The example
harness (gyre_jax.agents) sends them with :func:`call_headers` and :func:`api_key`.
This module imports only the standard library and ``gyre_jax.trajectory.vocab``, so
a harness can import it without numpy, jax or the rest of serving.

HTTP headers sent with every ``POST {base_url}/chat/completions``:

  ============================  ============================================
  ``X-Gyre-Run``                run id
  ``X-Gyre-Rollout``            rollout id (unique within the run)
  ``X-Gyre-Task``               task id (rollouts of one task share it)
  ``X-Gyre-Group``              group id (rollouts compared with each other)
  ``X-Gyre-Agent``              agent id inside the rollout, decimal int:
                                0 = main agent, 1, 2, ... = sub-agents in
                                spawn order
  ``X-Gyre-Parent-Agent``       agent id of the spawner; ABSENT for agent 0
  ``X-Gyre-Role``               ``main`` | ``subagent`` | ``summary``
                                (``trajectory.vocab.ROLES``)
                                (``summary`` = a compaction call; it carries
                                the id of the agent being compacted)
  ``X-Gyre-Call``               0-based sequence number of the logical call
                                within the rollout; a retry of a failed call
                                re-sends the SAME number, so a server that did
                                get the first attempt can tell it is a retry
  ``X-Gyre-Attempt``            0 for the first try of a call, 1, 2, ... for
                                retries
  ============================  ============================================

API key: ``Authorization: Bearer gyre:<run>:<rollout>`` (see :func:`api_key`),
for harnesses that can set a key but no headers (the Claude Code CLI, most SDKs), on a
proxy that issues no keys. It is derivable from the ids, so a proxy that issues random
per-rollout keys (``Proxy.register_rollout``) refuses it, and headers without an issued key.
Headers win where both are present. Ids are restricted to ``[A-Za-z0-9_.-]`` so the
key splits unambiguously on ``:``.

Rollout statuses and agent roles are the trajectory's (``gyre_jax.trajectory.vocab``).
"""
from __future__ import annotations

import re

from gyre_jax.trajectory.vocab import ROLES

HEADER_RUN = "X-Gyre-Run"
HEADER_ROLLOUT = "X-Gyre-Rollout"
HEADER_TASK = "X-Gyre-Task"
HEADER_GROUP = "X-Gyre-Group"
HEADER_AGENT = "X-Gyre-Agent"
HEADER_PARENT_AGENT = "X-Gyre-Parent-Agent"
HEADER_ROLE = "X-Gyre-Role"
HEADER_CALL = "X-Gyre-Call"
HEADER_ATTEMPT = "X-Gyre-Attempt"

API_KEY_PREFIX = "gyre"
_ID_RE = re.compile(r"[A-Za-z0-9_.\-]+")


def check_id(value: str, what: str) -> str:
    """Raise a clear error unless ``value`` is a usable id (no ':' or spaces)."""
    if not isinstance(value, str) or not _ID_RE.fullmatch(value):
        raise ValueError(f"{what} must be a non-empty string of [A-Za-z0-9_.-], got {value!r}")
    return value


def api_key(run_id: str, rollout_id: str) -> str:
    """``gyre:<run>:<rollout>``, the per-rollout API key."""
    return f"{API_KEY_PREFIX}:{check_id(run_id, 'run id')}:{check_id(rollout_id, 'rollout id')}"


def parse_api_key(key: str) -> tuple[str, str] | None:
    """(run, rollout) from a ``gyre:<run>:<rollout>`` key (a ``Bearer `` prefix is
    accepted); None when the key is not in that form (e.g. a plain bearer token)."""
    if key.startswith("Bearer "):
        key = key[len("Bearer "):]
    parts = key.strip().split(":")
    if len(parts) != 3 or parts[0] != API_KEY_PREFIX:
        return None
    if not (_ID_RE.fullmatch(parts[1]) and _ID_RE.fullmatch(parts[2])):
        return None
    return parts[1], parts[2]


def api_key_problem(key: str) -> str | None:
    """Why a key that claims the ``gyre:`` form is not a valid rollout key; None if it is valid or is
    not in that form at all (a plain token). The proxy answers such a key with 400, not "unbound"."""
    if key.startswith("Bearer "):
        key = key[len("Bearer "):]
    key = key.strip()
    if not key.startswith(API_KEY_PREFIX + ":"):
        return None
    parts = key.split(":")
    if len(parts) != 3:
        return (f"API key {key!r}: a rollout key is {API_KEY_PREFIX}:<run>:<rollout> (3 parts separated by ':'), "
                f"got {len(parts)} parts")
    for what, v in (("run", parts[1]), ("rollout", parts[2])):
        if not _ID_RE.fullmatch(v):
            return f"API key {key!r}: {what} id {v!r} must be a non-empty string of [A-Za-z0-9_.-]"
    return None


def call_headers(*, run_id: str, rollout_id: str, task_id: str, group_id: str, agent_id: int,
                 parent_agent_id: int | None, role: str, call_index: int, attempt: int) -> dict[str, str]:
    """The headers of one model call (see the module docstring)."""
    if role not in ROLES:
        raise ValueError(f"unknown role {role!r}; known: {ROLES}")
    h = {
        HEADER_RUN: run_id,
        HEADER_ROLLOUT: rollout_id,
        HEADER_TASK: task_id,
        HEADER_GROUP: group_id,
        HEADER_AGENT: str(int(agent_id)),
        HEADER_ROLE: role,
        HEADER_CALL: str(int(call_index)),
        HEADER_ATTEMPT: str(int(attempt)),
    }
    if parent_agent_id is not None:
        h[HEADER_PARENT_AGENT] = str(int(parent_agent_id))
    return h
