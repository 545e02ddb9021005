"""Rollouts: workspace, agent run under a deadline, grading, status; many at once.

``RolloutResult.to_outcome`` turns a result into the trajectory ``RolloutOutcome``.

Status of a rollout (``gyre_jax.trajectory.vocab.STATUSES``):

  completed       the main agent ended (finish / no tool call / max_turns) and the
                  grader scored the workspace
  timeout         the deadline hit first; the agent was cancelled (running commands
                  killed), the workspace kept and graded: the score is partial credit
  infra_error     the model server failed a call after retries (or answered something
                  unusable), or the harness itself raised; not graded, score None
  verifier_error  the grader crashed, timed out or returned garbage; score None

``score`` is None unless the status is completed or timeout: a failure is never a 0.
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
import shutil
import time
import traceback
from pathlib import Path
from typing import AsyncIterator, Sequence

import aiohttp

from gyre_jax.agents import sandbox as sandbox_lib
from gyre_jax.agents import tools
from gyre_jax.agents.agent import DEFAULT_SYSTEM_PROMPT, Agent, RolloutContext, Transport
from gyre_jax.agents.client import ChatClient, InfraError
from gyre_jax.agents.config import HarnessConfig
from gyre_jax.agents.graders import grader_sandbox_env, run_grader, snapshot_workspace
from gyre_jax.agents.tasks import test_suite as task_test_suite
from gyre_jax.agents.tasks.base import Task
from gyre_jax.serving.identity import check_id
from gyre_jax.trajectory.vocab import (
    ROLE_MAIN,
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
    snapshot: str = ""  # the copy of the workspace the grader read
    # SandboxStats.to_dict() plus "snapshot" (files, bytes, skipped, truncated)
    sandbox: dict = dataclasses.field(default_factory=dict)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    def to_outcome(self, run_id: str, *, policy_versions=(), num_calls: int | None = None):
        """The trajectory ``RolloutOutcome`` record. ``details`` holds the grader's
        details, the harness counters and the error (if any), so failures keep their
        reason. ``num_calls``: the proxy's count of recorded calls, if known."""
        from gyre_jax.trajectory.records import RolloutOutcome  # numpy: only when records are made
        harness = {k: getattr(self, k) for k in (
            "calls", "retries", "compactions", "subagents", "tool_calls", "tool_errors", "finish_reason",
            "wall_time_s", "agent_time_s", "grader_time_s", "workspace", "snapshot", "sandbox")}
        return RolloutOutcome(run_id=run_id, rollout_id=self.rollout_id, task_id=self.task_id,
                              group_id=self.group_id, status=self.status, score=self.score,
                              details={"grader": self.grader_details, "harness": harness, "error": self.error},
                              policy_versions=tuple(policy_versions), t_end=self.t_end, num_calls=num_calls)


def http_transport(client: ChatClient) -> Transport:
    async def transport(messages, headers, tool_schemas):
        return await client.chat(messages, headers=headers, tools=tool_schemas)
    return transport


SNAPSHOTS = ".snapshots"  # under workspace_root: the graded copies


def prepare_workspace(workspace_root: str | Path, rollout_id: str, task: Task,
                      sandbox: sandbox_lib.Sandbox | None = None) -> Path:
    """Make the rollout's (empty) workspace, let its sandbox own it, write the task's files."""
    if rollout_id == SNAPSHOTS:
        raise ValueError(f"rollout id {rollout_id!r} is reserved for the graded snapshots")
    path = Path(workspace_root) / rollout_id
    if path.exists() and any(path.iterdir()):
        raise FileExistsError(f"workspace {path} for rollout {rollout_id!r} already holds files; "
                              "rollout ids must be unique")
    path.mkdir(parents=True, exist_ok=True)
    if sandbox is not None:
        sandbox.prepare()
    ws = tools.Workspace(path, sandbox=sandbox)
    for rel, content in task.setup_files.items():
        ws.write_file(rel, content)
    return path


async def run_rollout(request: RolloutRequest, config: HarnessConfig, *, workspace_root: str | Path,
                      transport: Transport, grader_slots: asyncio.Semaphore | None = None) -> RolloutResult:
    """One rollout, start to graded result. Never raises for model, tool or grader
    failures (they become the status); raises only for caller errors (bad workspace)."""
    t0 = time.monotonic()
    task = request.task
    path = Path(workspace_root) / request.rollout_id
    snapshot = Path(workspace_root) / SNAPSHOTS / request.rollout_id
    if snapshot.exists():
        raise FileExistsError(f"snapshot {snapshot} for rollout {request.rollout_id!r} exists; "
                              "rollout ids must be unique")
    sandbox = sandbox_lib.make_sandbox(config.sandbox, path, family=task.family, name=request.rollout_id,
                                       commands="run" in task.tools or tools.RUN_TESTS in task.tools)
    try:
        await asyncio.to_thread(prepare_workspace, workspace_root, request.rollout_id, task, sandbox)
        ws = tools.Workspace(path, max_output_bytes=config.max_tool_output_bytes,
                             command_timeout_s=config.command_timeout_s, sandbox=sandbox,
                             test_suite=task_test_suite(task) if tools.RUN_TESTS in task.tools else None)
        ctx = RolloutContext(config=config, task=task, rollout_id=request.rollout_id, group_id=request.group_id,
                             workspace=ws, transport=transport)
        status, error, finish_reason = await _run_agent(ctx, config, task)
        agent_time = time.monotonic() - t0
        # The agent has ended and every command with it: what the grader sees is fixed now.
        try:
            snap = await asyncio.to_thread(snapshot_workspace, path, snapshot,
                                           max_bytes=config.sandbox.limits.disk_bytes,
                                           max_entries=config.sandbox.limits.max_files)
        except OSError as e:  # the grader cannot see the workspace: no score, and say why
            snap = {"error": f"{type(e).__name__}: {e}"}
            if status in (None, STATUS_TIMEOUT):
                status, error = STATUS_VERIFIER_ERROR, f"workspace snapshot failed: {snap['error']}"
    finally:
        tmpfs = sandbox.tmpfs
        sandbox.release()  # synchronous: a second cancellation must not leave a tmpfs mounted
    if tmpfs and snapshot.is_dir():  # the unmounted workspace shows what was graded
        await asyncio.to_thread(shutil.copytree, snapshot, path, dirs_exist_ok=True)
    sandbox_info = {**sandbox.stats.to_dict(), "snapshot": snap}

    score, details, grader_time = None, {}, 0.0
    if status in (None, STATUS_TIMEOUT):
        async with grader_slots or contextlib.nullcontext():
            g = await run_grader(task, snapshot, timeout_s=config.grader_timeout_s,
                                 env=grader_sandbox_env(sandbox.kind, config.sandbox.limits, sandbox.image))
        grader_time = g.wall_time_s
        if g.ok:
            score, details, status = g.score, g.details, status or STATUS_COMPLETED
        else:
            status, error = STATUS_VERIFIER_ERROR, g.error
    s = ctx.stats
    return RolloutResult(
        rollout_id=request.rollout_id, task_id=task.task_id, group_id=request.group_id, status=status,
        score=score, grader_details=details, calls=s.calls, retries=s.retries, compactions=s.compactions,
        subagents=s.subagents, tool_calls=s.tool_calls, tool_errors=s.tool_errors, finish_reason=finish_reason,
        error=error, wall_time_s=time.monotonic() - t0, agent_time_s=agent_time, grader_time_s=grader_time,
        workspace=str(path), t_end=time.time(), snapshot=str(snapshot), sandbox=sandbox_info)


async def _run_agent(ctx: RolloutContext, config: HarnessConfig, task: Task):
    """(status, error, finish_reason) of the main agent under the deadline; status None: it ended."""
    status = error = finish_reason = None
    deadline = asyncio.timeout(config.deadline_s)
    try:
        async with deadline:
            outcome = await Agent(ctx, role=ROLE_MAIN, user_prompt=task.prompt,
                                  system_prompt=config.system_prompt or task.system_prompt or DEFAULT_SYSTEM_PROMPT
                                  ).run()
        finish_reason = outcome.finish_reason
    except TimeoutError:
        if deadline.expired():
            status = STATUS_TIMEOUT
        else:  # a TimeoutError that is not our deadline is a bug somewhere below
            status, error = STATUS_INFRA_ERROR, "harness error: " + traceback.format_exc(limit=5)
    except InfraError as e:
        status, error = STATUS_INFRA_ERROR, str(e)
    except Exception:  # a harness bug must surface as a failure, never as a score
        status, error = STATUS_INFRA_ERROR, "harness error: " + traceback.format_exc(limit=5)
    return status, error, finish_reason


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
        if now - self.last < self.every_s and self.done < self.total:
            return
        self.last = now
        rate = self.done / max(now - self.t0, 1e-9)
        eta = (self.total - self.done) / rate if rate > 0 else float("inf")
        log.info("rollouts %d/%d done, %d in flight, %.2f/s, ETA %.0f s, %s", self.done, self.total, in_flight,
                 rate, eta, dict(self.statuses))


async def iter_rollouts(requests: Sequence[RolloutRequest], config: HarnessConfig, *, workspace_root: str | Path,
                        session: aiohttp.ClientSession | None = None) -> AsyncIterator[RolloutResult]:
    """Run ``requests`` with at most ``config.concurrency`` in flight; yield each result as
    it finishes (so finished groups can stream into training)."""
    ids = [r.rollout_id for r in requests]
    dupes = sorted(k for k, n in collections.Counter(ids).items() if n > 1)
    if dupes:
        raise ValueError(f"duplicate rollout ids: {dupes[:10]}")
    own = session is None
    if own:  # connection limit off: the semaphore is the limit
        session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0))
    client = ChatClient(session, config)
    transport = http_transport(client)
    slots = asyncio.Semaphore(config.concurrency)
    grader_slots = asyncio.Semaphore(config.grader_slots)
    progress = _Progress(len(requests))
    running = 0

    async def one(req: RolloutRequest) -> RolloutResult:
        nonlocal running
        async with slots:
            running += 1
            try:
                return await run_rollout(req, config, workspace_root=workspace_root, transport=transport,
                                         grader_slots=grader_slots)
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
        if own:
            await session.close()


async def run_rollouts(requests: Sequence[RolloutRequest], config: HarnessConfig, *, workspace_root: str | Path,
                       session: aiohttp.ClientSession | None = None) -> list[RolloutResult]:
    """All results, in the order of ``requests``."""
    by_id = {}
    async for result in iter_rollouts(requests, config, workspace_root=workspace_root, session=session):
        by_id[result.rollout_id] = result
    return [by_id[r.rollout_id] for r in requests]


def group_requests(task: Task, n: int, *, group_id: str, prefix: str | None = None) -> list[RolloutRequest]:
    """``n`` rollouts of one task in one group, ids ``<prefix>-<k>`` (prefix = group id)."""
    prefix = prefix or group_id
    return [RolloutRequest(rollout_id=f"{prefix}-{k}", task=task, group_id=group_id) for k in range(n)]
