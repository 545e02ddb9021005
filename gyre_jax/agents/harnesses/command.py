"""A harness that is a command: any agent CLI (mini-swe-agent, Claude Code, a script) per rollout.

For every rollout the command runs INSIDE the rollout's sandbox (``sandbox.launch_harness``):
its working directory is the workspace (``/workspace``), its own commands are the policy's
actions, and its network is a private namespace whose only door is the proxy (a unix socket
bound in, served on ``127.0.0.1:PORT`` by ``bridge.py``). Its environment:

  OPENAI_BASE_URL / OPENAI_API_BASE     http://127.0.0.1:PORT/v1
  ANTHROPIC_BASE_URL                    http://127.0.0.1:PORT
  OPENAI_API_KEY / ANTHROPIC_API_KEY    the rollout's key (ties its calls to the rollout)
  GYRE_TASK_ID, GYRE_ROLLOUT_ID         ids
  GYRE_INSTRUCTION                      the instruction (omitted if over 100 KB: use the file)
  GYRE_INSTRUCTION_FILE                 a read-only file holding it
  GYRE_WORKSPACE                        /workspace
  + its ``env`` option (e.g. MSWEA_CONFIGURED=true), HOME=/tmp (a private tmpfs)

In the command, ``{instruction_file}``, ``{workspace}`` and ``{task_id}`` are replaced by
those values, shell-quoted (nothing else is touched: ``${VAR}`` and JSON braces stay).
The harness sees read-only the running Python's prefix and base prefix (so a CLI installed
in this venv runs) plus ``ro_paths`` (e.g. its config files, a node install for Claude Code);
their ``bin`` directories lead PATH.

Ending: exit 0 is a finished episode (graded). A non-zero exit, a death by signal or a bridge
that could not start is ``HarnessFailed``, unless ``nonzero_exit="graded"`` says this harness
exits non-zero when its agent gives up. The runner makes that ``infra_error`` when no model call
was made (the harness or its command is broken: the policy had no say) or the model server
failed the rollout, else a score of 0: the policy's commands run in the harness's sandbox and
can kill it (``kill -9 $PPID``), which must not beat failing. The
deadline kills the sandbox (every process of it) and the rollout is a timeout, graded for
partial credit. Output (stdout and stderr together) is kept bounded while it streams:
``output_bytes`` from its start and as many from its end.
"""
from __future__ import annotations

import asyncio
import dataclasses
import os
import shlex
import signal
import sys
import tempfile
from pathlib import Path
from typing import ClassVar, Mapping

from gyre_jax.agents.capture import BoundedCapture, drain_async
from gyre_jax.agents.harnesses import HARNESS_KINDS, Episode, HarnessFailed, HarnessResult
from gyre_jax.agents.sandbox import WORKSPACE_MOUNT, SandboxLimits
from gyre_jax.agents.tasks.base import Task

BRIDGE_PORT = 8000  # inside the sandbox's own network namespace: always free
GYRE_DIR = "/run/gyre"  # where the instruction file and the proxy socket appear in the sandbox
NONZERO_EXIT = ("infra_error", "graded")
MAX_ENV_INSTRUCTION = 100_000  # bytes; an argv/env string must stay under the kernel's 128 KiB
BRIDGE_FAILED = 97
_WRAPPER = ('"$1" -I -c "$2" 127.0.0.1 "$3" "$4" || { echo "gyre: the proxy bridge did not start" >&2; '
            f'exit {BRIDGE_FAILED}; }}; exec bash -c "$5"')


def default_ro_paths() -> tuple[str, ...]:
    """This Python's installation (the venv and the interpreter it was made from)."""
    paths = []
    for p in (sys.prefix, sys.base_prefix, os.path.dirname(os.path.dirname(os.path.realpath(sys.executable)))):
        p = os.path.realpath(p)
        if p not in paths and p != "/":
            paths.append(p)
    return tuple(paths)


def substitute(command: str, values: Mapping[str, str]) -> str:
    """``{name}`` -> the shell-quoted value, for the placeholders in ``values`` only."""
    for name, value in values.items():
        command = command.replace("{" + name + "}", shlex.quote(value))
    return command


@dataclasses.dataclass(frozen=True, kw_only=True)
class CommandOptions:
    """``--config.harness.kind_options.command.*``."""

    # e.g. "mini -y --exit-immediately -t \"$(cat {instruction_file})\"" ({instruction_file}, {workspace},
    # {task_id} are replaced, shell-quoted); OPENAI_/ANTHROPIC_BASE_URL and _API_KEY are set.
    command: str = ""
    env: Mapping[str, str] = dataclasses.field(default_factory=dict)  # extra environment
    ro_paths: str = ""  # comma-separated host paths it sees read-only (besides this Python's)
    nonzero_exit: str = "infra_error"  # infra_error | graded (its non-zero exit means "gave up")
    output_bytes: int = 16384  # bytes of its output kept from the start, and from the end
    cpu_s: int = 3600  # CPU seconds per process of the harness
    memory_bytes: int = 8 << 30  # address space per process (node needs several GiB)
    tmp_bytes: int = 256 << 20  # its private /tmp

    def __post_init__(self):
        object.__setattr__(self, "env", dict(self.env))
        if not isinstance(self.ro_paths, str):  # a tuple of paths, as a caller in code writes it
            object.__setattr__(self, "ro_paths", ",".join(self.ro_paths))


@HARNESS_KINDS.register("command", config=CommandOptions,
                        summary="a shell command per rollout (any agent CLI), run inside the rollout's sandbox")
class CommandHarness:
    kind: ClassVar[str] = "command"

    def __init__(self, options: CommandOptions, *, unix_socket: str | None = None):
        o = options
        if not isinstance(o.command, str) or not o.command.strip():
            raise ValueError("harness.kind_options.command.command must be a non-empty shell command")
        if o.nonzero_exit not in NONZERO_EXIT:
            raise ValueError(f"harness.kind_options.command.nonzero_exit must be one of {NONZERO_EXIT}, "
                             f"got {o.nonzero_exit!r}")
        for k, v in o.env.items():
            if not isinstance(k, str) or not k or "=" in k or not isinstance(v, str) or "\0" in k + v:
                raise ValueError(f"harness.kind_options.command.env: {k!r}={v!r} is not a valid environment variable")
        if o.output_bytes < 256:
            raise ValueError(f"harness.kind_options.command.output_bytes must be >= 256, got {o.output_bytes}")
        self.command, self.env, self.nonzero_exit = o.command, dict(o.env), o.nonzero_exit
        extra = tuple(p.strip() for p in o.ro_paths.split(",") if p.strip())
        self.ro_paths = tuple(dict.fromkeys((*default_ro_paths(), *extra)))
        self.output_bytes = o.output_bytes
        # the whole sandbox (its cgroup) is capped at the memory limit too (SandboxLimits.sandbox_memory_bytes)
        self.limits = SandboxLimits(cpu_s=o.cpu_s, memory_bytes=o.memory_bytes, tmp_bytes=o.tmp_bytes)
        self.unix_socket = unix_socket

    def needs_commands(self, task: Task) -> bool:
        return True

    def _environment(self, episode: Episode, base_url: str, instruction_file: str, workspace: str) -> dict:
        t, c = episode.task, episode.client
        bins = [os.path.join(p, "bin") for p in self.ro_paths if os.path.isdir(os.path.join(p, "bin"))]
        env = {
            "PATH": os.pathsep.join(bins + ["/usr/local/bin", "/usr/bin", "/bin"]),
            "HOME": "/tmp", "OPENAI_BASE_URL": base_url + "/v1", "OPENAI_API_BASE": base_url + "/v1",
            "ANTHROPIC_BASE_URL": base_url, "OPENAI_API_KEY": c.api_key, "ANTHROPIC_API_KEY": c.api_key,
            "GYRE_TASK_ID": t.task_id, "GYRE_ROLLOUT_ID": t.rollout_id, "GYRE_INSTRUCTION_FILE": instruction_file,
            "GYRE_WORKSPACE": workspace, "GYRE_MODEL": c.model,
        }
        if len(t.instruction.encode()) <= MAX_ENV_INSTRUCTION:
            env["GYRE_INSTRUCTION"] = t.instruction
        env.update(self.env)
        return env

    async def run(self, episode: Episode) -> HarnessResult:
        t, c = episode.task, episode.client
        sandbox = t.tools.sandbox
        if sandbox is None:
            raise HarnessFailed("a command harness needs the rollout's sandbox (none was made)")
        with tempfile.TemporaryDirectory(prefix="gyre-harness-") as tmp:
            os.chmod(tmp, 0o755)
            instruction = Path(tmp) / "instruction.md"
            instruction.write_text(t.instruction)
            os.chmod(instruction, 0o644)
            if sandbox.kind == "none":  # debugging: the host's network, the proxy's own TCP address
                base = c.anthropic_base_url.rstrip("/")
                paths = {"instruction_file": str(instruction), "workspace": t.workspace_path, "task_id": t.task_id}
                argv = ["bash", "-c", substitute(self.command, paths)]
                launch = sandbox.launch_harness(argv, env=self._environment(episode, base, str(instruction),
                                                                            t.workspace_path), limits=self.limits)
            else:
                if not self.unix_socket:
                    raise HarnessFailed("a sandboxed command harness needs the proxy's unix socket "
                                        "(ProxyConfig.unix_path)")
                inner_sock, inner_instr = f"{GYRE_DIR}/proxy.sock", f"{GYRE_DIR}/instruction.md"
                base = f"http://127.0.0.1:{BRIDGE_PORT}"
                paths = {"instruction_file": inner_instr, "workspace": WORKSPACE_MOUNT, "task_id": t.task_id}
                from gyre_jax.agents.harnesses import bridge

                argv = ["bash", "-c", _WRAPPER, "gyre-harness", sys.executable, Path(bridge.__file__).read_text(),
                        str(BRIDGE_PORT), inner_sock, substitute(self.command, paths)]
                launch = sandbox.launch_harness(
                    argv, env=self._environment(episode, base, inner_instr, WORKSPACE_MOUNT), limits=self.limits,
                    ro_paths=self.ro_paths,
                    binds=(("--ro-bind", str(instruction), inner_instr), ("--ro-bind", self.unix_socket, inner_sock)))
            return await self._run(launch, t.workspace_path, t)

    async def _run(self, launch, cwd: str, task) -> HarnessResult:
        capture = BoundedCapture(head=self.output_bytes, tail=self.output_bytes)
        try:
            proc = await asyncio.create_subprocess_exec(
                *launch.argv, cwd=cwd, stdin=asyncio.subprocess.DEVNULL, stdout=asyncio.subprocess.PIPE,
                stderr=asyncio.subprocess.STDOUT, env=launch.env, start_new_session=True)
        except OSError as e:
            raise HarnessFailed(f"the harness could not start: {type(e).__name__}: {e}",
                                why=f"the harness could not start: {type(e).__name__}") from None
        reader = asyncio.ensure_future(drain_async(proc.stdout, capture))
        try:
            code = await proc.wait()
        except BaseException:  # the deadline (cancellation): the whole sandbox goes, output kept
            _kill(proc)
            try:
                await asyncio.wait_for(proc.wait(), 5.0)
                await asyncio.wait({reader}, timeout=2.0)
            except BaseException:
                pass
            reader.cancel()
            task.counters["output"] = capture.text()
            raise
        await asyncio.wait({reader}, timeout=5.0)  # a process outside the sandbox may hold the pipe (kind none)
        reader.cancel()
        out = capture.text()
        task.counters["output"] = out
        task.counters["output_bytes"] = capture.total
        if code == 0 or (code > 0 and self.nonzero_exit == "graded"):
            return HarnessResult(finish_reason=f"exit {code}", output=out, exit_code=code)
        if code < 0:
            why = f"the harness was killed by signal {-code} ({signal.Signals(-code).name})"
        elif code == BRIDGE_FAILED and "gyre: the proxy bridge did not start" in out:
            why = "the proxy bridge in the sandbox did not start"
        else:
            why = f"the harness exited with code {code}"
        tail = capture.tail_text(600).strip()
        raise HarnessFailed(f"{why}; its output ends: {tail!r}" if tail else why, output=out, exit_code=code, why=why)


def _kill(proc) -> None:
    if proc.returncode is None:
        try:
            os.killpg(proc.pid, signal.SIGKILL)  # bwrap's pid namespace ends with it: every process goes
        except ProcessLookupError:
            pass
