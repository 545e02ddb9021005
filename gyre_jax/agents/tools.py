"""Tools an agent can call inside its workspace, their OpenAI schemas, and parsing.

Two ways a model can call a tool, both accepted on every turn:

1. OpenAI structured calls: ``message.tool_calls = [{"id", "type": "function",
   "function": {"name", "arguments": "<json object>"}}]``. Results go back as
   ``{"role": "tool", "tool_call_id": id, "content": text}`` messages.
2. Plain text, for tiny models that cannot emit structured calls: anywhere in the
   assistant ``content``, one block per call::

       <tool>write_file {"path": "answer.txt", "content": "cba"}</tool>
       <tool>finish</tool>

   i.e. ``<tool>NAME</tool>`` or ``<tool>NAME {JSON object}</tool>``. Results go back
   in ONE ``user`` message, ``<result>text</result>`` per executed call, joined by
   newlines (a ``user`` message, because a ``tool`` message must follow structured
   ``tool_calls`` under the OpenAI API). Structured calls win when a reply has both.

A malformed call (bad JSON, unknown tool, wrong argument) is not dropped: it is answered
with ``error: ...`` so the model can correct itself, and counted as a tool error.

``run`` executes a shell command in the workspace through the rollout's sandbox
(``gyre_jax.agents.sandbox``: read-only system, the workspace the only writable place, no
network, rlimits, every process killed at the command's end); the harness always passes
one. Without one (scripted demonstrations, tests of the tools themselves) it is plain
``bash -c`` on the host. The file tools run in the trainer and check that paths stay
inside the workspace. ``run_tests`` runs the task's own test suite
(``gyre_jax.agents.test_suite``) the same way; only tasks that list it offer it.
"""
from __future__ import annotations

import asyncio
import dataclasses
import json
import math
import os
import re
import signal
import stat
from pathlib import Path
from typing import Any

from gyre_jax.agents.sandbox import Sandbox
from gyre_jax.agents.test_suite import TestSuite
from gyre_jax.agents.tool_schemas import FINISH, RUN, RUN_TESTS, SPAWN_SUBAGENT, TOOL_NAMES, TOOL_SCHEMAS  # noqa: F401

_ARG_TYPES: dict[str, type | tuple[type, ...]] = {"string": str, "number": (int, float)}


def openai_tools(names) -> list[dict]:
    """The ``tools`` request field for the given tool names."""
    return [{"type": "function", "function": {"name": n, **TOOL_SCHEMAS[n]}} for n in names]


class ToolError(Exception):
    """A tool call the model got wrong; its message goes back to the model."""


def check_args(name: str, args: Any) -> dict:
    """Validate ``args`` against the tool's schema; raise ToolError naming the problem."""
    if name not in TOOL_SCHEMAS:
        raise ToolError(f"unknown tool {name!r}; known: {', '.join(TOOL_NAMES)}")
    if not isinstance(args, dict):
        raise ToolError(f"{name}: arguments must be a JSON object, got {type(args).__name__}")
    params = TOOL_SCHEMAS[name]["parameters"]
    props = params["properties"]
    extra = sorted(set(args) - set(props))
    if extra:
        raise ToolError(f"{name}: unexpected argument(s) {extra}; allowed: {sorted(props)}")
    for key in params["required"]:
        if key not in args:
            raise ToolError(f"{name}: missing required argument {key!r}")
    for key, value in args.items():
        want = _ARG_TYPES[props[key]["type"]]
        if not isinstance(value, want) or isinstance(value, bool):
            raise ToolError(f"{name}: argument {key!r} must be {props[key]['type']}, got {type(value).__name__}")
        # The policy writes these: what Python's json accepts but no OS call does is the model's mistake
        # (an observation it can act on), never an infrastructure failure that drops the rollout.
        if isinstance(value, float) and not math.isfinite(value):
            raise ToolError(f"{name}: argument {key!r} must be a finite number, got {value!r}")
        if isinstance(value, str):
            if "\x00" in value:
                raise ToolError(f"{name}: argument {key!r} contains a NUL byte")
            try:
                value.encode("utf-8")
            except UnicodeEncodeError as e:
                raise ToolError(f"{name}: argument {key!r} is not valid text ({e.reason} at index {e.start})") from None
    return args


def _open_regular(path: Path, flags: int, what: str) -> int:
    """A descriptor of the regular file at ``path``, never blocking and never following a last-component link:
    a FIFO, device or socket the policy planted is refused (opening a FIFO would freeze the event loop)."""
    try:
        fd = os.open(path, flags | os.O_NONBLOCK | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
    except OSError as e:
        raise ToolError(f"{what}: cannot open {path.name!r}: {e.strerror}") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise ToolError(f"{what}: {path.name!r} is not a regular file")
        os.set_blocking(fd, True)  # a regular file: reads and writes complete; only the open had to not block
        return fd
    except BaseException:
        os.close(fd)
        raise


def write_regular(path: Path, data: bytes, what: str) -> None:
    fd = _open_regular(path, os.O_WRONLY | os.O_CREAT, what)
    with os.fdopen(fd, "wb") as f:
        f.truncate(0)  # after the checks: a FIFO is never truncated or written
        f.write(data)


def read_regular(path: Path, limit: int, what: str) -> tuple[bytes, int]:
    """(at most ``limit`` bytes, the file's size) of a regular file."""
    fd = _open_regular(path, os.O_RDONLY, what)
    with os.fdopen(fd, "rb") as f:
        return f.read(limit), os.fstat(f.fileno()).st_size


@dataclasses.dataclass(frozen=True)
class ToolCall:
    """One parsed call. ``error`` is set (and ``arguments`` None) when it did not parse."""
    name: str
    arguments: dict | None
    call_id: str | None = None  # the OpenAI id; None for plain-text calls
    error: str | None = None


_TEXT_CALL_RE = re.compile(r"<tool>(.*?)</tool>", re.DOTALL)
_NAME_RE = re.compile(r"\s*([A-Za-z_][A-Za-z0-9_]*)\s*")


def parse_text_tool_calls(text: str) -> list[ToolCall]:
    """Plain-text calls ``<tool>NAME {json}</tool>`` in order of appearance."""
    calls = []
    end = 0
    for m in _TEXT_CALL_RE.finditer(text):
        end = m.end()
        body = m.group(1)
        nm = _NAME_RE.match(body)
        if not nm:
            calls.append(ToolCall("", None, error=f"cannot read a tool name in <tool>{body[:80]}</tool>"))
            continue
        name, rest = nm.group(1), body[nm.end():].strip()
        if not rest:
            calls.append(ToolCall(name, {}))
            continue
        try:
            args = json.loads(rest)
        except json.JSONDecodeError as e:
            calls.append(ToolCall(name, None, error=f"{name}: arguments are not valid JSON ({e})"))
            continue
        calls.append(ToolCall(name, args))
    if "<tool>" in text[end:]:  # e.g. generation cut off by max_tokens
        calls.append(ToolCall("", None, error="unterminated <tool> block (missing </tool>)"))
    return calls


def parse_openai_tool_calls(message: dict) -> list[ToolCall]:
    """Structured ``tool_calls`` of an assistant message."""
    calls = []
    for k, tc in enumerate(message.get("tool_calls") or []):
        fn = tc.get("function") if isinstance(tc, dict) else None
        call_id = tc.get("id") if isinstance(tc, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            calls.append(ToolCall("", None, call_id, error=f"tool_calls[{k}] has no function name"))
            continue
        raw = fn.get("arguments") or "{}"
        try:
            args = json.loads(raw) if isinstance(raw, str) else raw
        except json.JSONDecodeError as e:
            calls.append(ToolCall(fn["name"], None, call_id, error=f"{fn['name']}: arguments are not valid JSON ({e})"))
            continue
        calls.append(ToolCall(fn["name"], args, call_id))
    return calls


def render_text_tool_call(name: str, args: dict) -> str:
    """The plain-text form of a call, as :func:`parse_text_tool_calls` reads it. A
    ``</`` inside the JSON is written ``<\\/`` (a valid JSON escape of ``/``) so content
    such as "</tool>" cannot end the block early."""
    if not args:
        return f"<tool>{name}</tool>"
    body = json.dumps(args, ensure_ascii=False).replace("</", "<\\/")
    return f"<tool>{name} {body}</tool>"


def render_text_results(results: list[str]) -> str:
    return "\n".join(f"<result>{r}</result>" for r in results)


def truncate_tail(text: str, limit: int) -> str:
    data = text.encode()
    if len(data) <= limit:
        return text
    return f"[... {len(data) - limit} bytes truncated]\n" + data[-limit:].decode(errors="replace")


class Workspace:
    """File and command tools rooted at one rollout's directory."""

    def __init__(self, root: str | os.PathLike, *, sandbox: "Sandbox | None", max_output_bytes: int = 4096,
                 command_timeout_s: float = 30.0, max_file_bytes: int = 1 << 20,
                 test_suite: "TestSuite | None" = None, test_wait: bool = True):
        """``sandbox``: where commands run, and a required choice: ``sandbox=None`` runs the policy's
        commands on the host, unconfined (tests, scripted demonstrations); a library user gets no
        isolation by forgetting an argument."""
        self.root = Path(root).resolve()
        self.max_output_bytes = max_output_bytes
        self.command_timeout_s = command_timeout_s
        self.max_file_bytes = max_file_bytes
        self.sandbox = sandbox
        self.test_suite = test_suite  # what run_tests runs (None: the task has no suite)
        # False: run_tests skips the suite's waiting (scripted demonstrations replay hundreds of
        # transcripts; the tool's text does not depend on how long the suite took)
        self.test_wait = test_wait

    def resolve(self, rel: str) -> Path:
        if not rel or os.path.isabs(rel):
            raise ToolError(f"path must be relative to the workspace, got {rel!r}")
        p = (self.root / rel).resolve()
        if p != self.root and self.root not in p.parents:
            raise ToolError(f"path {rel!r} leaves the workspace")
        return p

    def write_file(self, path: str, content: str) -> str:
        data = content.encode()
        if len(data) > self.max_file_bytes:
            raise ToolError(f"write_file: {len(data)} bytes exceeds the limit of {self.max_file_bytes}")
        p = self.resolve(path)
        if p.is_dir():
            raise ToolError(f"write_file: {path!r} is a directory")
        p.parent.mkdir(parents=True, exist_ok=True)
        write_regular(p, data, "write_file")
        if self.sandbox is not None:  # written by the trainer: hand it to the rollout's user
            self.sandbox.chown_new(p)
        return f"wrote {len(data)} bytes to {path}"

    def read_file(self, path: str) -> str:
        p = self.resolve(path)
        if not p.exists():
            raise ToolError(f"read_file: no file {path!r}")
        # no more than is shown: the file may be as large as the disk limit
        data, size = read_regular(p, self.max_output_bytes, "read_file")
        text = data.decode(errors="replace")
        if size > len(data):
            text += f"\n[... {size - len(data)} more bytes]"
        return text

    def list_files(self, path: str = ".", limit: int = 200) -> str:
        base = self.resolve(path) if path not in (".", "") else self.root
        if not base.is_dir():
            raise ToolError(f"list_files: no directory {path!r}")
        out = []
        for dirpath, dirnames, filenames in os.walk(base):
            dirnames[:] = sorted(d for d in dirnames if d != "__pycache__")
            for f in sorted(filenames):
                out.append(os.path.relpath(os.path.join(dirpath, f), self.root))
        if not out:
            return "(no files)"
        more = f"\n[... {len(out) - limit} more]" if len(out) > limit else ""
        return "\n".join(out[:limit]) + more

    async def run(self, command: str, timeout_s: float | None = None) -> str:
        limit = self.command_timeout_s if timeout_s is None else min(float(timeout_s), self.command_timeout_s)
        if limit <= 0:
            raise ToolError(f"run: timeout_s must be > 0, got {timeout_s}")
        return (await self._exec(command, limit))[0]

    async def execute(self, command: str, timeout_s: float) -> tuple[str, int | None]:
        """(output, exit code or None if it timed out) of ``command`` in the sandbox (not a tool:
        ``--check_tasks`` runs a task's reference solution through it)."""
        return await self._exec(command, float(timeout_s))

    async def run_tests(self) -> str:
        """Run the task's suite in the sandbox; on a normal exit write the receipt of what it tested."""
        from gyre_jax.agents import test_suite as ts  # light; only tasks with a suite get here

        suite = self.test_suite
        if suite is None:
            raise ToolError("run_tests: this task has no test suite")
        if not self.test_wait:
            suite = dataclasses.replace(suite, duration_s=0.0)
        text, code = await self._exec(suite.command(), suite.timeout_s)
        if code is not None:  # the suite finished (passed or failed): it tested the current answer
            answer = self.root / suite.answer_file
            tested = (read_regular(answer, self.max_file_bytes, "run_tests")[0].strip()
                      if answer.is_file() else b"")
            receipt = self.root / ts.RECEIPT_FILE
            if receipt.is_symlink() or receipt.is_dir():  # an agent's object in the way: not followed
                raise ToolError(f"run_tests: {ts.RECEIPT_FILE} must not be a link or directory")
            write_regular(receipt, ts.receipt(suite.receipt_key, tested).encode(), "run_tests")
            if self.sandbox is not None:
                self.sandbox.chown_new(receipt)
        return text

    async def _exec(self, command: str, limit: float) -> tuple[str, int | None]:
        """(tool text, exit code or None if it timed out) of ``command`` in the sandbox.

        The output streams into a head + tail capture of ``max_output_bytes`` in all: a command
        printing without end costs the trainer that much memory, not what it printed."""
        from gyre_jax.agents.capture import BoundedCapture, drain_async

        launch = self.sandbox.launch(command) if self.sandbox is not None else None
        argv = launch.argv if launch is not None else ["bash", "-c", command]
        proc = await asyncio.create_subprocess_exec(
            *argv, cwd=self.root, stdin=asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT,
            start_new_session=True)  # own process group: a timeout kills its children too
        head = self.max_output_bytes // 4  # mostly the end: where errors and results are printed
        capture = BoundedCapture(head=head, tail=self.max_output_bytes - head)
        reader = asyncio.ensure_future(drain_async(proc.stdout, capture))
        loop = asyncio.get_running_loop()
        deadline = loop.time() + limit
        try:
            await asyncio.wait_for(asyncio.shield(reader), limit)
            # a command may close its output and go on: the limit holds for the process too
            await asyncio.wait_for(proc.wait(), max(0.0, deadline - loop.time()))
        except TimeoutError:
            await _stop(proc, launch)
            # what the command printed before the kill; a grandchild that escaped the group
            # may hold the pipe open: stop reading after a second
            await asyncio.wait({reader}, timeout=1.0)
            reader.cancel()
            await proc.wait()
            text = capture.text()
            return (f"timed out after {limit:g} s\n" + text + self._observe(text, capture, timed_out=True)), None
        except BaseException:  # deadline cancellation: never leave a command running
            reader.cancel()
            try:
                await _stop(proc, launch)
                await asyncio.wait_for(proc.wait(), 5.0)  # reap it, so no transport outlives the event loop
            except BaseException:
                pass
            raise
        text = capture.text()
        return (f"exit code {proc.returncode}\n" + text + self._observe(text, capture, timed_out=False)), \
            proc.returncode

    def _observe(self, text: str, capture, *, timed_out: bool) -> str:
        if self.sandbox is None:
            return ""
        return self.sandbox.observe(text, timed_out=timed_out, truncated=capture.dropped > 0)

    async def call(self, name: str, args: dict) -> str:
        """Run a workspace tool (everything but finish / spawn_subagent)."""
        args = check_args(name, args)
        if name == "write_file":
            return self.write_file(args["path"], args["content"])
        if name == "read_file":
            return self.read_file(args["path"])
        if name == "list_files":
            return self.list_files(args.get("path", "."))
        if name == "run":
            return await self.run(args["command"], args.get("timeout_s"))
        if name == RUN_TESTS:
            return await self.run_tests()
        raise ToolError(f"{name} is not a workspace tool")


def _kill_group(proc) -> None:
    if proc.returncode is None:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


async def _stop(proc, launch) -> None:
    """SIGKILL the command's process group (a bubblewrap sandbox's pid namespace dies with it);
    a container is stopped by its runtime."""
    _kill_group(proc)
    if launch is not None and launch.kill_argv:
        killer = await asyncio.create_subprocess_exec(*launch.kill_argv, stdout=asyncio.subprocess.DEVNULL,
                                                      stderr=asyncio.subprocess.DEVNULL)
        await killer.wait()
