"""Rollouts: workspace, agent run under a deadline, grading, status; many at once.

``RolloutResult.to_outcome`` turns a result into the trajectory ``RolloutOutcome``.

Status of a rollout (``gyre_jax.trajectory.vocab.STATUSES``):

  completed       the main agent ended (finish / no tool call / max_turns) and the
                  grader scored the workspace; or the harness failed in a way the policy
                  could cause (below): score 0 with its ``reason``
  timeout         the deadline hit first; the agent was cancelled (running commands
                  killed), the workspace kept and graded: the score is partial credit
  infra_error     a failure outside the policy's reach: the model server failed a call
                  after retries or failed one of the rollout's calls, the harness failed
                  before its first model call (a broken harness: the policy had no say),
                  the workspace could not be snapshotted (host, storage); score None
  verifier_error  gyre's grading machinery failed (the grader process crashed or timed
                  out: never the graded code, whose crashes and hangs score 0); score None

Every failure the policy can cause is its own 0 and trains: a grader that fails on the policy's
tree scores 0 (``verdict_command``, ``verdict_pytest``); a harness that fails after the policy
made a call (the policy's commands share its sandbox: ``kill -9 $PPID``) scores 0 without
grading. ``reason`` names what happened in a few words that are the same for every rollout
that failed the same way; ``error`` has the details (``infra_error``/``verifier_error``).
``score`` is None only for infra_error and verifier_error: those are never a 0.
Each rollout works in ``workspace_root/<rollout_id>`` (which must not already hold
files), its commands confined by its own sandbox (``config.sandbox``; see
``gyre_jax.agents.sandbox``). When the agent has ended (its commands all dead) the
workspace's files are copied to ``workspace_root/.snapshots/<rollout_id>``, which the
grader reads and which stays on disk; a plain workspace is left as it was, a tmpfs one
(see sandbox.py) is unmounted and gets the snapshot's files. ``RolloutResult.sandbox`` says what the commands ran into.
"""
from __future__ import annotations

import asyncio
import collections
import contextlib
import dataclasses
import logging
import os
import sys
import time
import traceback
from pathlib import Path
from typing import AsyncIterator, Protocol, Sequence

import aiohttp

from gyre_jax.agents import sandbox as sandbox_lib
from gyre_jax.agents import tools
from gyre_jax.agents.capture import bound_json, bound_text
from gyre_jax.agents.client import InfraError
from gyre_jax.agents.config import HarnessConfig
from gyre_jax.agents.graded_tree import copy_repo
from gyre_jax.agents.graders import grader_sandbox_env, run_grader, snapshot_workspace
from gyre_jax.agents.harnesses import ClientConfig, Episode, EpisodeTask, Harness, HarnessFailed, make_harness
from gyre_jax.agents.tasks import test_suite as task_test_suite
from gyre_jax.agents.tasks.base import Task
from gyre_jax.serving.identity import HEADER_GROUP, HEADER_ROLLOUT, HEADER_RUN, HEADER_TASK, api_key, check_id
from gyre_jax.trajectory.vocab import (
    STATUS_COMPLETED,
    STATUS_INFRA_ERROR,
    STATUS_TIMEOUT,
    STATUS_VERIFIER_ERROR,
)

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True, kw_only=True)
class RolloutRequest:
    rollout_id: str  # unique within the run; names the workspace directory
    task: Task
    group_id: str  # rollouts whose rewards are compared (one task, one step)

    def __post_init__(self):
        check_id(self.rollout_id, "RolloutRequest.rollout_id")
        check_id(self.group_id, "RolloutRequest.group_id")
        if not isinstance(self.task, Task):
            raise TypeError(f"RolloutRequest {self.rollout_id}: task must be a Task, got {type(self.task).__name__}")


@dataclasses.dataclass(kw_only=True)
class RolloutResult:
    rollout_id: str
    task_id: str
    group_id: str
    status: str  # one of vocab.STATUSES
    score: float | None  # partial credit in [0, 1]; None for infra/verifier errors
    grader_details: dict
    calls: int  # successful model calls (main, sub-agents, summaries)
    retries: int
    compactions: int
    subagents: int
    tool_calls: int
    tool_errors: int
    finish_reason: str | None  # how the main agent ended; None on timeout / infra error
    error: str | None  # why, for infra_error / verifier_error
    wall_time_s: float  # start to result, grading included
    agent_time_s: float
    grader_time_s: float
    workspace: str
    t_end: float  # unix seconds when the result was ready
    reason: str | None = None  # why it failed or scored 0 without grading (short: the same for the same cause)
    snapshot: str = ""  # the copy of the workspace the grader read
    # SandboxStats.to_dict() plus "snapshot" (files, bytes, skipped, truncated)
    sandbox: dict = dataclasses.field(default_factory=dict)
    harness_kind: str = "builtin"
    exit_code: int | None = None  # a command harness's exit code
    output_tail: str = ""  # the end of a command harness's output (all of what was kept: log_path)
    log_path: str = ""

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    def to_outcome(self, run_id: str, *, policy_versions=(), num_calls: int | None = None):
        """The trajectory ``RolloutOutcome`` record. ``details`` holds the grader's
        details, the harness counters and the error (if any), so failures keep their
        reason. ``num_calls``: the proxy's count of recorded calls, if known."""
        from gyre_jax.trajectory.records import RolloutOutcome  # numpy: only when records are made
        harness = {k: getattr(self, k) for k in (
            "calls", "retries", "compactions", "subagents", "tool_calls", "tool_errors", "finish_reason",
            "wall_time_s", "agent_time_s", "grader_time_s", "workspace", "snapshot", "sandbox", "harness_kind",
            "exit_code", "output_tail", "log_path", "reason")}
        if num_calls is not None:
            # The proxy's count is the truth: a command or python harness counts nothing itself (it read 0
            # with every call recorded). What the harness counted, if anything else, stays beside it.
            harness["calls"] = num_calls
            if self.calls != num_calls:
                harness["harness_counted_calls"] = self.calls
        return RolloutOutcome(run_id=run_id, rollout_id=self.rollout_id, task_id=self.task_id,
                              group_id=self.group_id, status=self.status, score=self.score,
                              # every field cut to the record bounds (capture.RECORD_*), whatever
                              # a grader, a harness or an error message carried
                              details={"grader": bound_json(self.grader_details), "harness": bound_json(harness),
                                       "error": None if self.error is None else bound_text(self.error),
                                       "reason": None if self.reason is None else bound_text(self.reason)},
                              policy_versions=tuple(policy_versions), t_end=self.t_end, num_calls=num_calls)


SNAPSHOTS = ".snapshots"  # under workspace_root: the graded copies
LOGS = ".logs"  # under workspace_root: each command harness's bounded output
BASES = ".bases"  # under workspace_root: the tasks' own trees, built once (graded_tree.cached_base)
OUTPUT_TAIL_BYTES = 2048  # of a harness's output kept in the outcome record


class KeyIssuer(Protocol):
    """Issues each rollout its API key and takes it back when the rollout ends (the proxy):
    a call is recorded only under a key issued for its rollout, and no call after its end."""

    def issue(self, run_id: str, rollout_id: str, task_id: str, group_id: str) -> str: ...

    def revoke(self, key: str) -> None: ...

    # Optional: ``usage(key) -> {"calls", "server_errors"}`` so far (the proxy has it). Without it a
    # failed harness is judged by its own call counter (the built-in agent keeps one).


def prepare_workspace(workspace_root: str | Path, rollout_id: str, task: Task,
                      sandbox: sandbox_lib.Sandbox | None = None) -> Path:
    """Make the rollout's (empty) workspace, let its sandbox own it, copy the task's repository
    in (if any), then write the task's files."""
    if rollout_id in (SNAPSHOTS, LOGS, BASES):
        raise ValueError(f"rollout id {rollout_id!r} is reserved")
    path = Path(workspace_root) / rollout_id
    if path.exists() and any(path.iterdir()):
        raise FileExistsError(f"workspace {path} for rollout {rollout_id!r} already holds files; "
                              "rollout ids must be unique")
    path.mkdir(parents=True, exist_ok=True)
    if sandbox is not None:
        sandbox.prepare()
    if task.repo:
        copy_repo(task.repo, task.repo_commit, path)
        if sandbox is not None:
            sandbox.chown_tree(path)
    ws = tools.Workspace(path, sandbox=sandbox, max_file_bytes=1 << 30)
    for rel, content in task.setup_files.items():
        ws.write_file(rel, content)
    return path


def grader_timeout(task: Task, config: HarnessConfig) -> float:
    """The grading subprocess's limit: the harness's, or a task's own command timeout plus a margin."""
    own = task.params.get("grader_timeout_s") if task.family == "dataset" else None
    return max(config.grader_timeout_s, float(own) + 30.0) if own else config.grader_timeout_s


def client_config(request: RolloutRequest, config: HarnessConfig, key: str, session=None) -> ClientConfig:
    base = config.base_url
    return ClientConfig(
        openai_base_url=base, anthropic_base_url=base[:-3] if base.endswith("/v1") else base, api_key=key,
        model=config.model, session=session, harness_config=config,
        headers={HEADER_RUN: config.run_id, HEADER_ROLLOUT: request.rollout_id, HEADER_TASK: request.task.task_id,
                 HEADER_GROUP: request.group_id})


@dataclasses.dataclass
class _Ended:
    """How the agent part of a rollout ended (before grading)."""
    status: str | None  # None: it ended by itself (graded); else timeout / infra_error / completed (a 0)
    error: str | None = None
    reason: str | None = None
    finish_reason: str | None = None
    exit_code: int | None = None
    snapshot_stats: dict = dataclasses.field(default_factory=dict)
    counters: dict = dataclasses.field(default_factory=dict)
    output: str = ""
    tmpfs: bool = False


async def run_rollout(request: RolloutRequest, config: HarnessConfig, *, workspace_root: str | Path,
                      harness: Harness | None = None, keys: KeyIssuer | None = None, session=None,
                      grader_slots: asyncio.Semaphore | None = None) -> RolloutResult:
    """One rollout, start to graded result, with ``harness`` (default: the built-in agent).
    Never raises for model, harness, tool or grader failures (they become the status); raises
    only for caller errors (bad workspace)."""
    t0 = time.monotonic()
    harness = harness or make_harness("builtin")
    root = Path(workspace_root)
    path, snapshot = root / request.rollout_id, root / SNAPSHOTS / request.rollout_id
    if snapshot.exists():
        raise FileExistsError(f"snapshot {snapshot} for rollout {request.rollout_id!r} exists; "
                              "rollout ids must be unique")
    sandbox = sandbox_lib.make_sandbox(config.sandbox, path, family=request.task.family, name=request.rollout_id,
                                       commands=harness.needs_commands(request.task))
    ended = await _run_agent(request, config, root, harness, sandbox, keys, session)
    agent_time = time.monotonic() - t0
    if ended.tmpfs and snapshot.is_dir():  # the unmounted workspace shows what was graded
        # the same copy as the snapshot's: sparse files stay sparse, nothing is followed
        await asyncio.to_thread(snapshot_workspace, snapshot, path, max_bytes=sys.maxsize, max_entries=sys.maxsize,
                                exist_ok=True)
    log_path = ""
    if ended.output:
        log_path = str(root / LOGS / f"{request.rollout_id}.log")
        await asyncio.to_thread(_write_log, log_path, ended.output)
    score, details, grader_time = None, {}, 0.0
    status, error, reason = ended.status, ended.error, ended.reason
    if status == STATUS_COMPLETED:  # a failure the policy could cause: its own 0, not graded
        score, details = 0.0, {"reason": reason, "exact": False}
    elif status in (None, STATUS_TIMEOUT):
        async with grader_slots or contextlib.nullcontext():
            g = await run_grader(request.task, snapshot, timeout_s=grader_timeout(request.task, config),
                                 env=grader_sandbox_env(sandbox.kind, config.sandbox.limits, sandbox.image,
                                                        config.grader_ro_paths),
                                 bases=root / BASES, carry_deletions=not ended.snapshot_stats.get("truncated"))
        grader_time = g.wall_time_s
        if g.ok:
            score, details, status = g.score, g.details, status or STATUS_COMPLETED
        else:
            status, error, reason = STATUS_VERIFIER_ERROR, g.error, "the grader process failed"
    n = {k: int(ended.counters.get(k, 0)) for k in ("calls", "retries", "compactions", "subagents", "tool_calls",
                                                     "tool_errors")}
    return RolloutResult(
        rollout_id=request.rollout_id, task_id=request.task.task_id, group_id=request.group_id, status=status,
        score=score, grader_details=details, **n, finish_reason=ended.finish_reason, error=error, reason=reason,
        wall_time_s=time.monotonic() - t0, agent_time_s=agent_time, grader_time_s=grader_time,
        workspace=str(path), t_end=time.time(), snapshot=str(snapshot),
        sandbox={**sandbox.stats.to_dict(), "snapshot": ended.snapshot_stats}, harness_kind=harness.kind,
        exit_code=ended.exit_code, output_tail=ended.output[-OUTPUT_TAIL_BYTES:] if ended.output else "",
        log_path=log_path)


async def _run_agent(request: RolloutRequest, config: HarnessConfig, root: Path, harness: Harness,
                     sandbox: sandbox_lib.Sandbox, keys: KeyIssuer | None, session) -> _Ended:
    """Workspace, key, harness under the deadline, then the snapshot; the sandbox released."""
    task, path = request.task, root / request.rollout_id
    key = None
    ended = _Ended(None)
    try:
        await asyncio.to_thread(prepare_workspace, root, request.rollout_id, task, sandbox)
        ws = tools.Workspace(path, max_output_bytes=config.max_tool_output_bytes,
                             command_timeout_s=config.command_timeout_s, sandbox=sandbox,
                             test_suite=task_test_suite(task) if tools.RUN_TESTS in task.tools else None)
        key = (keys.issue(config.run_id, request.rollout_id, task.task_id, request.group_id) if keys is not None
               else config.api_key if config.api_key is not None else api_key(config.run_id, request.rollout_id))
        etask = EpisodeTask(task_id=task.task_id, instruction=task.prompt, system_prompt=task.system_prompt,
                            metadata=task.metadata, rollout_id=request.rollout_id, group_id=request.group_id,
                            run_id=config.run_id, workspace_path=str(path), tools=ws, spec=task)
        deadline = task.deadline_s * config.deadline_scale if task.deadline_s else config.deadline_s
        episode = Episode(etask, client_config(request, config, key, session), deadline)
        ended = await _run_harness(harness, episode)
        usage = keys.usage(key) if keys is not None and hasattr(keys, "usage") else None
        if keys is not None:  # no call of this rollout is recorded after this point
            keys.revoke(key)
            key = None
        ended = _classify(ended, usage, etask.counters)
        ended.counters = dict(etask.counters)
        ended.output = ended.counters.pop("output", "")
        # The agent has ended and every command with it: what the grader sees is fixed now.
        try:
            ended.snapshot_stats = await asyncio.to_thread(
                snapshot_workspace, path, root / SNAPSHOTS / request.rollout_id,
                max_bytes=config.sandbox.limits.disk_bytes, max_entries=config.sandbox.limits.max_files)
        except OSError as e:  # the host's disk, not the policy's doing: no score, and say why
            ended.snapshot_stats = {"error": f"{type(e).__name__}: {e}"}
            if ended.status in (None, STATUS_TIMEOUT):
                ended.status, ended.reason = STATUS_INFRA_ERROR, "the workspace snapshot failed"
                ended.error = f"workspace snapshot failed: {ended.snapshot_stats['error']}"
    finally:
        if key is not None and keys is not None:
            keys.revoke(key)
        ended.tmpfs = sandbox.tmpfs
        sandbox.release()  # synchronous: a second cancellation must not leave a tmpfs mounted
    return ended


def _classify(ended: _Ended, usage: dict | None, counters: dict) -> _Ended:
    """A harness failure (``infra_error`` from ``_run_harness``) the policy could have caused
    becomes its own 0: it made a model call and the model server failed none of them."""
    if ended.status != STATUS_INFRA_ERROR or ended.reason == MODEL_SERVER:
        return ended
    calls = usage["calls"] if usage is not None else int(counters.get("calls", 0))
    if usage is not None and usage.get("server_errors"):
        ended.reason = f"the model server failed {usage['server_errors']} of the rollout's calls, then {ended.reason}"
        return ended
    if calls == 0:
        ended.reason = f"{ended.reason} before its first model call"
        return ended
    ended.status = STATUS_COMPLETED
    ended.error = f"{ended.error} (after {calls} model calls: the policy's commands can end the harness; scored 0)"
    return ended


def _write_log(path: str, text: str) -> None:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w", errors="replace") as f:
        f.write(text)


MODEL_SERVER = "the model server failed a call after retries"


async def _run_harness(harness: Harness, episode: Episode) -> _Ended:
    """How the harness ended under the deadline (status None: by itself)."""
    deadline = asyncio.timeout(episode.deadline_s)
    try:
        async with deadline:
            result = await harness.run(episode)
        episode.task.counters.update(result.counters)
        return _Ended(None, finish_reason=result.finish_reason, exit_code=result.exit_code)
    except TimeoutError:
        if deadline.expired():
            return _Ended(STATUS_TIMEOUT)
        # a TimeoutError that is not our deadline is a bug somewhere below
        return _Ended(STATUS_INFRA_ERROR, "harness error: " + traceback.format_exc(limit=5),
                      "the harness raised TimeoutError")
    except InfraError as e:
        episode.task.counters["retries"] = episode.task.counters.get("retries", 0)
        return _Ended(STATUS_INFRA_ERROR, str(e), MODEL_SERVER)
    except HarnessFailed as e:
        return _Ended(STATUS_INFRA_ERROR, f"harness failed: {e}", f"harness: {e.why}", finish_reason="harness_failed",
                      exit_code=e.exit_code)
    except Exception as e:  # a harness bug must surface as a failure, never as a score
        return _Ended(STATUS_INFRA_ERROR, "harness error: " + traceback.format_exc(limit=5),
                      f"harness raised {type(e).__name__}", finish_reason="harness_failed")


class _Progress:
    """A log line at most every ``every_s`` seconds: done, in flight, rate, ETA, statuses."""

    def __init__(self, total: int, every_s: float = 10.0):
        self.total, self.every_s = total, every_s
        self.t0 = self.last = time.monotonic()
        self.done = 0
        self.statuses: collections.Counter = collections.Counter()

    def update(self, result: RolloutResult, in_flight: int) -> None:
        self.done += 1
        self.statuses[result.status] += 1
        now = time.monotonic()
        if self.every_s == float("inf") or (now - self.last < self.every_s and self.done < self.total):
            return
        self.last = now
        rate = self.done / max(now - self.t0, 1e-9)
        eta = (self.total - self.done) / rate if rate > 0 else float("inf")
        log.info("rollouts %d/%d done, %d in flight, %.2f/s, ETA %.0f s, %s", self.done, self.total, in_flight,
                 rate, eta, dict(self.statuses))


async def iter_rollouts(requests: Sequence[RolloutRequest], config: HarnessConfig, *, workspace_root: str | Path,
                        session: aiohttp.ClientSession | None = None, harness: Harness | None = None,
                        keys: KeyIssuer | None = None, progress_log: bool = True) -> AsyncIterator[RolloutResult]:
    """Run ``requests`` with ``harness`` (default: the built-in agent), at most
    ``config.concurrency`` in flight; yield each result as it finishes (so finished groups can
    stream into training). ``progress_log=False`` where a caller shows its own progress (the RL
    loop runs one group at a time through here)."""
    ids = [r.rollout_id for r in requests]
    dupes = sorted(k for k, n in collections.Counter(ids).items() if n > 1)
    if dupes:
        raise ValueError(f"duplicate rollout ids: {dupes[:10]}")
    own = session is None
    if own:  # connection limit off: the semaphore is the limit
        session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0))
    harness = harness or make_harness("builtin")
    slots = asyncio.Semaphore(config.concurrency)
    grader_slots = asyncio.Semaphore(config.grader_slots)
    progress = _Progress(len(requests), every_s=10.0 if progress_log else float("inf"))
    running = 0

    async def one(req: RolloutRequest) -> RolloutResult:
        nonlocal running
        async with slots:
            running += 1
            try:
                return await run_rollout(req, config, workspace_root=workspace_root, harness=harness, keys=keys,
                                         session=session, grader_slots=grader_slots)
            finally:
                running -= 1

    pending = [asyncio.create_task(one(r)) for r in requests]
    try:
        for fut in asyncio.as_completed(pending):
            result = await fut
            progress.update(result, running)
            yield result
    finally:
        for t in pending:
            t.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
        if own and session is not None:
            await session.close()


async def run_rollouts(requests: Sequence[RolloutRequest], config: HarnessConfig, *, workspace_root: str | Path,
                       session: aiohttp.ClientSession | None = None, harness: Harness | None = None,
                       keys: KeyIssuer | None = None) -> list[RolloutResult]:
    """All results, in the order of ``requests``."""
    by_id = {}
    async for result in iter_rollouts(requests, config, workspace_root=workspace_root, session=session,
                                      harness=harness, keys=keys):
        by_id[result.rollout_id] = result
    return [by_id[r.rollout_id] for r in requests]


def group_requests(task: Task, n: int, *, group_id: str, prefix: str | None = None) -> list[RolloutRequest]:
    """``n`` rollouts of one task in one group, ids ``<prefix>-<k>`` (prefix = group id)."""
    prefix = prefix or group_id
    return [RolloutRequest(rollout_id=f"{prefix}-{k}", task=task, group_id=group_id) for k in range(n)]
