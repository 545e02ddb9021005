"""Tools, call parsing, the wire convention and config validation (no server)."""
import asyncio
import json
import os
import subprocess
import sys

import pytest

from gyre_jax.agents.config import HarnessConfig
from gyre_jax.agents.tools import (
    ToolCall,
    ToolError,
    Workspace,
    check_args,
    parse_openai_tool_calls,
    parse_text_tool_calls,
    render_text_tool_call,
)
from gyre_jax.serving import identity
from gyre_jax.trajectory.vocab import ROLE_SUBAGENT


def test_text_tool_calls_parse_and_round_trip():
    text = 'thinking...\n<tool>write_file {"path": "a.txt", "content": "x"}</tool> then <tool> finish </tool>'
    assert parse_text_tool_calls(text) == [ToolCall("write_file", {"path": "a.txt", "content": "x"}),
                                           ToolCall("finish", {})]
    assert parse_text_tool_calls("no calls here") == []
    args = {"path": "p", "content": 'a "</tool>" b\nc'}
    assert parse_text_tool_calls(render_text_tool_call("write_file", args)) == [ToolCall("write_file", args)]
    [bad] = parse_text_tool_calls('<tool>write_file {"path": </tool>')
    assert bad.arguments is None and "not valid JSON" in bad.error
    [cut] = parse_text_tool_calls('<tool>write_file {"path": "a"')
    assert "unterminated" in cut.error
    [noname] = parse_text_tool_calls("<tool>{}</tool>")
    assert "tool name" in noname.error


def test_openai_tool_calls_parse():
    msg = {"tool_calls": [{"id": "c1", "type": "function", "function": {"name": "read_file",
                                                                         "arguments": '{"path": "x"}'}},
                          {"id": "c2", "type": "function", "function": {"name": "run", "arguments": "{oops"}},
                          {"id": "c3"}]}
    a, b, c = parse_openai_tool_calls(msg)
    assert a == ToolCall("read_file", {"path": "x"}, "c1")
    assert b.call_id == "c2" and "not valid JSON" in b.error
    assert c.call_id == "c3" and "no function name" in c.error


def test_check_args_names_the_problem():
    for name, args, msg in [("rm", {}, "unknown tool"), ("write_file", {"path": "a"}, "missing required"),
                            ("read_file", {"path": "a", "x": 1}, "unexpected argument"),
                            ("run", {"command": 3}, "must be string"), ("list_files", [], "JSON object")]:
        with pytest.raises(ToolError, match=msg):
            check_args(name, args)


def test_workspace_tools_and_path_safety(tmp_path):
    ws = Workspace(tmp_path / "w", sandbox=None, max_output_bytes=64)
    ws.root.mkdir()
    assert ws.write_file("d/a.txt", "hello") == "wrote 5 bytes to d/a.txt"
    assert ws.read_file("d/a.txt") == "hello"
    assert ws.list_files() == "d/a.txt"
    (tmp_path / "secret").write_text("s")
    os.symlink(tmp_path / "secret", ws.root / "link")
    for bad in ("../secret", "/etc/passwd", "link", ""):
        with pytest.raises(ToolError):
            ws.read_file(bad)
    ws.write_file("big.txt", "x" * 100)
    assert ws.read_file("big.txt").endswith("[... 36 more bytes]")
    with pytest.raises(ToolError, match="no file"):
        ws.read_file("missing")


def test_run_tool_reports_exit_code_truncates_and_times_out(tmp_path):
    # Quick commands get a generous cap so a loaded machine cannot time them out;
    # the time-limit check uses its own workspace with a short cap.
    ws = Workspace(tmp_path, sandbox=None, max_output_bytes=32, command_timeout_s=30.0)
    capped = Workspace(tmp_path, sandbox=None, max_output_bytes=32, command_timeout_s=0.5)

    async def main():
        ok = await ws.run("echo hi; exit 3")
        long = await ws.run("head -c 100 /dev/zero | tr '\\0' y; echo")
        slow = await capped.run("echo started; sleep 30", timeout_s=10)  # capped at 0.5 s
        closed = await capped.run("echo started; exec >&- 2>&-; sleep 30")  # no output left to wait on
        return ok, long, slow, closed

    ok, long, slow, closed = asyncio.run(main())
    assert closed.startswith("timed out after 0.5 s\nstarted"), closed
    assert ok == "exit code 3\nhi\n"
    # a quarter of the bound from the start, the rest from the end, and how much was dropped
    assert long == "exit code 0\n" + "y" * 8 + "\n[... 69 bytes not kept ...]\n" + "y" * 23 + "\n"
    assert slow.startswith("timed out after 0.5 s")


_FLOOD = """
import asyncio, json, resource, sys
from gyre_jax.agents.tools import Workspace
ws = Workspace(sys.argv[1], sandbox=None, max_output_bytes=4096, command_timeout_s=120.0)
asyncio.run(ws.run("echo warm"))
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
text = asyncio.run(ws.run("printf START; head -c 52428800 /dev/zero | tr '\\\\0' x; printf END"))
grown = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before
print(json.dumps({"grown_kib": grown, "text": text}))
"""


def test_run_tool_keeps_a_bounded_head_and_tail_while_streaming(tmp_path):
    # 50 MiB of output: the trainer's peak memory must not grow by it (the old code buffered
    # it whole, then cut it); the tool text shows the head, the tail and how much was dropped.
    # A fresh process: its peak RSS is this call's, not an earlier test's.
    proc = subprocess.run([sys.executable, "-c", _FLOOD, str(tmp_path)], capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    assert got["grown_kib"] < 16 * 1024, got["grown_kib"]
    text = got["text"]
    dropped = 50 * (1 << 20) + len("STARTEND") - 4096
    assert text.startswith("exit code 0\nSTART" + "x" * (1024 - 5)), text[:100]
    assert f"\n[... {dropped} bytes not kept ...]\n" in text and text.endswith("x" * 100 + "END")
    assert len(text.encode()) < 4096 + 100


def test_wire_ids_and_api_key():
    assert identity.api_key("run-1", "r.7") == "gyre:run-1:r.7"
    assert identity.parse_api_key("Bearer gyre:run-1:r.7") == ("run-1", "r.7")
    assert identity.parse_api_key("sk-something") is None and identity.parse_api_key("gyre:a:b:c") is None
    with pytest.raises(ValueError, match="rollout id"):
        identity.api_key("run", "a:b")
    h = identity.call_headers(run_id="r", rollout_id="x", task_id="t", group_id="g", agent_id=2, parent_agent_id=0,
                              role=ROLE_SUBAGENT, call_index=5, attempt=0)
    assert h[identity.HEADER_PARENT_AGENT] == "0" and h[identity.HEADER_CALL] == "5"
    with pytest.raises(ValueError, match="unknown role"):
        identity.call_headers(run_id="r", rollout_id="x", task_id="t", group_id="g", agent_id=0,
                              parent_agent_id=None, role="boss", call_index=0, attempt=0)


def test_the_grader_subprocess_and_the_wire_names_import_no_numpy():
    # One vocabulary (trajectory.vocab) serves records, rewards, the harness and the
    # proxy; it and the wire convention stay importable without numpy/jax/aiohttp, so
    # the grader subprocess and any harness pay for none of them.
    code = ("import sys, gyre_jax.agents.grader_main, gyre_jax.serving.identity, gyre_jax.trajectory.vocab; "
            "print(sorted(m for m in ('numpy', 'jax', 'aiohttp', 'jetstream') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]", out.stdout + out.stderr


def test_serving_does_not_import_the_example_harness():
    # Dependencies go one way: agents -> serving, never serving -> agents.
    code = ("import sys, gyre_jax.serving.proxy; "
            "print(sorted(m for m in sys.modules if m.startswith('gyre_jax.agents')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]", out.stdout + out.stderr


def test_config_validation():
    with pytest.raises(ValueError, match="base_url"):
        HarnessConfig(base_url="localhost:8000")
    with pytest.raises(ValueError, match="deadline_s must be > 0"):
        HarnessConfig(base_url="http://x/v1", deadline_s=0)
    with pytest.raises(ValueError, match="may not set"):
        HarnessConfig(base_url="http://x/v1", extra_body={"messages": []})
    with pytest.raises(ValueError, match="run_id"):
        HarnessConfig(base_url="http://x/v1", run_id="a b")
    with pytest.raises(TypeError):
        HarnessConfig(base_url="http://x/v1", max_turn=3)  # misspelled field fails loudly
    assert HarnessConfig(base_url="http://x/v1/").base_url == "http://x/v1"


@pytest.mark.parametrize("name, args, says", [
    ("run", {"command": "true", "timeout_s": float("nan")}, "finite"),
    ("run", {"command": "true", "timeout_s": float("inf")}, "finite"),
    ("write_file", {"path": "a\x00b", "content": "x"}, "NUL"),
    ("write_file", {"path": "a", "content": "x\ud800y"}, "not valid text"),
    ("run", {"command": "echo \udcff"}, "not valid text"),
])
def test_arguments_json_accepts_but_no_os_call_does_are_tool_errors(tmp_path, name, args, says):
    """The policy can no longer turn its own rollout into an infra_error (dropped from training) with them."""
    ws = Workspace(tmp_path, sandbox=None)
    with pytest.raises(ToolError, match=says):
        asyncio.run(ws.call(name, args))


def test_file_tools_never_block_on_a_fifo_or_device(tmp_path):
    """A FIFO planted by the policy froze the trainer's event loop (write_file waited for a reader)."""
    os.mkfifo(tmp_path / "answer.txt")
    ws = Workspace(tmp_path, sandbox=None)

    async def calls():
        out = []
        for name, args in (("write_file", {"path": "answer.txt", "content": "42"}),
                           ("read_file", {"path": "answer.txt"})):
            try:
                out.append(await asyncio.wait_for(ws.call(name, args), 5))
            except ToolError as e:
                out.append(f"ToolError: {e}")
        return out

    wrote, read = asyncio.run(calls())
    assert wrote.startswith("ToolError") and "answer.txt" in wrote, wrote
    assert read.startswith("ToolError") and "not a regular file" in read, read
    os.symlink("/dev/zero", tmp_path / "z")  # a link out of the workspace is refused by path, a device by type
    with pytest.raises(ToolError):
        ws.read_file("z")


def test_a_workspace_without_a_sandbox_choice_is_refused(tmp_path):
    """No isolation is a spelled-out choice (sandbox=None), never what a forgotten argument gives."""
    with pytest.raises(TypeError, match="sandbox"):
        Workspace(tmp_path)
