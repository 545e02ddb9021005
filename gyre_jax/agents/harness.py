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
import os
import shutil
import subprocess
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
from gyre_jax.agents.graders import grader_sandbox_env, run_grader, snapshot_workspace
from gyre_jax.agents.harnesses import (ClientConfig, Episode, EpisodeTask, Harness, HarnessFailed,
                                       make_harness)
from gyre_jax.agents.tasks import test_suite as task_test_suite
from gyre_jax.agents.tasks.base import Task
from gyre_jax.serving.identity import (HEADER_GROUP, HEADER_ROLLOUT, HEADER_RUN, HEADER_TASK, api_key,
                                       check_id)
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
            "exit_code", "output_tail", "log_path")}
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
                                       "error": None if self.error is None else bound_text(self.error)},
                              policy_versions=tuple(policy_versions), t_end=self.t_end, num_calls=num_calls)


SNAPSHOTS = ".snapshots"  # under workspace_root: the graded copies
LOGS = ".logs"  # under workspace_root: each command harness's bounded output
OUTPUT_TAIL_BYTES = 2048  # of a harness's output kept in the outcome record


class KeyIssuer(Protocol):
    """Issues each rollout its API key and takes it back when the rollout ends (the proxy):
    a call is recorded only under a key issued for its rollout, and no call after its end."""

    def issue(self, run_id: str, rollout_id: str, task_id: str, group_id: str) -> str: ...

    def revoke(self, key: str) -> None: ...


def prepare_workspace(workspace_root: str | Path, rollout_id: str, task: Task,
                      sandbox: sandbox_lib.Sandbox | None = None) -> Path:
    """Make the rollout's (empty) workspace, let its sandbox own it, copy the task's repository
    in (if any), then write the task's files."""
    if rollout_id in (SNAPSHOTS, LOGS):
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


def copy_repo(repo: str, commit: str, dest: Path) -> None:
    """``repo`` (a local directory, or with ``commit`` a local git repository checked out at it)
    into the existing, empty ``dest``."""
    if commit:
        for argv in (["git", "clone", "--quiet", "--no-hardlinks", "--no-checkout", repo, str(dest)],
                     ["git", "-C", str(dest), "checkout", "--quiet", "--detach", commit]):
            r = subprocess.run(argv, capture_output=True, text=True, timeout=600,
                               env={**os.environ, "GIT_TERMINAL_PROMPT": "0"})
            if r.returncode != 0:
                raise RuntimeError(f"copying repo {repo}@{commit}: {' '.join(argv[:3])} failed: {r.stderr[-500:]}")
        return
    shutil.copytree(repo, dest, symlinks=True, dirs_exist_ok=True)


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


async def run_rollout(request: RolloutRequest, config: HarnessConfig, *, workspace_root: str | Path,
                      harness: Harness | None = None, keys: KeyIssuer | None = None, session=None,
                      grader_slots: asyncio.Semaphore | None = None) -> RolloutResult:
    """One rollout, start to graded result, with ``harness`` (default: the built-in agent).
    Never raises for model, harness, tool or grader failures (they become the status); raises
    only for caller errors (bad workspace)."""
    t0 = time.monotonic()
    harness = harness or make_harness("builtin")
    task = request.task
    path = Path(workspace_root) / request.rollout_id
    snapshot = Path(workspace_root) / SNAPSHOTS / request.rollout_id
    if snapshot.exists():
        raise FileExistsError(f"snapshot {snapshot} for rollout {request.rollout_id!r} exists; "
                              "rollout ids must be unique")
    sandbox = sandbox_lib.make_sandbox(config.sandbox, path, family=task.family, name=request.rollout_id,
                                       commands=harness.needs_commands(task))
    key = None
    try:
        await asyncio.to_thread(prepare_workspace, workspace_root, request.rollout_id, task, sandbox)
        ws = tools.Workspace(path, max_output_bytes=config.max_tool_output_bytes,
                             command_timeout_s=config.command_timeout_s, sandbox=sandbox,
                             test_suite=task_test_suite(task) if tools.RUN_TESTS in task.tools else None)
        key = (keys.issue(config.run_id, request.rollout_id, task.task_id, request.group_id) if keys is not None
               else config.api_key if config.api_key is not None else api_key(config.run_id, request.rollout_id))
        etask = EpisodeTask(task_id=task.task_id, instruction=task.prompt, system_prompt=task.system_prompt,
                            metadata=task.metadata, rollout_id=request.rollout_id, group_id=request.group_id,
                            run_id=config.run_id, workspace_path=str(path), tools=ws, spec=task)
        episode = Episode(etask, client_config(request, config, key, session), task.deadline_s or config.deadline_s)
        status, error, finish_reason, exit_code = await _run_harness(harness, episode)
        if keys is not None:  # no call of this rollout is recorded after this point
            keys.revoke(key)
            key = None
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
        if key is not None and keys is not None:
            keys.revoke(key)
        tmpfs = sandbox.tmpfs
        sandbox.release()  # synchronous: a second cancellation must not leave a tmpfs mounted
    if tmpfs and snapshot.is_dir():  # the unmounted workspace shows what was graded
        # the same copy as the snapshot's: sparse files stay sparse, nothing is followed
        await asyncio.to_thread(snapshot_workspace, snapshot, path, max_bytes=sys.maxsize, max_entries=sys.maxsize,
                                exist_ok=True)
    counters = dict(etask.counters)
    output = counters.pop("output", "")
    log_path = ""
    if output:
        log_path = str(Path(workspace_root) / LOGS / f"{request.rollout_id}.log")
        await asyncio.to_thread(_write_log, log_path, output)
    sandbox_info = {**sandbox.stats.to_dict(), "snapshot": snap}

    score, details, grader_time = None, {}, 0.0
    if status in (None, STATUS_TIMEOUT):
        async with grader_slots or contextlib.nullcontext():
            g = await run_grader(task, snapshot, timeout_s=grader_timeout(task, config),
                                 env=grader_sandbox_env(sandbox.kind, config.sandbox.limits, sandbox.image))
        grader_time = g.wall_time_s
        if g.ok:
            score, details, status = g.score, g.details, status or STATUS_COMPLETED
        else:
            status, error = STATUS_VERIFIER_ERROR, g.error
    n = {k: int(counters.get(k, 0)) for k in ("calls", "retries", "compactions", "subagents", "tool_calls",
                                               "tool_errors")}
    return RolloutResult(
        rollout_id=request.rollout_id, task_id=task.task_id, group_id=request.group_id, status=status,
        score=score, grader_details=details, **n, finish_reason=finish_reason,
        error=error, wall_time_s=time.monotonic() - t0, agent_time_s=agent_time, grader_time_s=grader_time,
        workspace=str(path), t_end=time.time(), snapshot=str(snapshot), sandbox=sandbox_info,
        harness_kind=harness.kind, exit_code=exit_code,
        output_tail=output[-OUTPUT_TAIL_BYTES:] if output else "", log_path=log_path)


def _write_log(path: str, text: str) -> None:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w", errors="replace") as f:
        f.write(text)


async def _run_harness(harness: Harness, episode: Episode):
    """(status, error, finish_reason, exit code) of the harness under the deadline; status None: it ended."""
    status = error = finish_reason = exit_code = None
    deadline = asyncio.timeout(episode.deadline_s)
    try:
        async with deadline:
            result = await harness.run(episode)
        finish_reason, exit_code = result.finish_reason, result.exit_code
        episode.task.counters.update(result.counters)
    except TimeoutError:
        if deadline.expired():
            status = STATUS_TIMEOUT
        else:  # a TimeoutError that is not our deadline is a bug somewhere below
            status, error = STATUS_INFRA_ERROR, "harness error: " + traceback.format_exc(limit=5)
    except InfraError as e:
        status, error = STATUS_INFRA_ERROR, str(e)
        episode.task.counters["retries"] = episode.task.counters.get("retries", 0)
    except HarnessFailed as e:
        status, error, exit_code = STATUS_INFRA_ERROR, f"harness failed: {e}", e.exit_code
    except Exception:  # a harness bug must surface as a failure, never as a score
        status, error = STATUS_INFRA_ERROR, "harness error: " + traceback.format_exc(limit=5)
    return status, error, finish_reason, exit_code


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
