"""examples/harnesses/shell_agent.py (configs/smol_agent.py's harness) against a scripted OpenAI-compatible server:
the command of each reply runs in the working directory, its output goes back as the next user message, the
episode stops on DONE, and a reply's command is read from a fenced block or a single line."""
import asyncio
import importlib.util
import os
import sys

from gyre_jax.testing.fake_openai_server import FakeOpenAIServer, FakeReply

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
AGENT = os.path.join(ROOT, "examples", "harnesses", "shell_agent.py")


def _agent():
    spec = importlib.util.spec_from_file_location("shell_agent", AGENT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_command_of_reads_blocks_and_single_lines():
    a = _agent()
    assert a.command_of("Sure:\n```bash\necho hi > a.txt\n```\nDone soon") == "echo hi > a.txt"
    assert a.command_of("```\nls\n```") == "ls"
    assert a.command_of("```sh\ntouch x") == "touch x"  # a block cut by max_tokens still runs
    assert a.command_of("`mkdir data`") == "mkdir data"
    assert a.command_of("DONE") is None and a.command_of("Done.") is None
    assert a.command_of("I think\nthe answer is\nunclear") is None


def test_episode_runs_commands_and_feeds_back_their_output(tmp_path):
    replies = ["```bash\necho apple > answer.txt && cat answer.txt\n```", "DONE", "```bash\nrm answer.txt\n```"]
    (tmp_path / "task.txt").write_text("Write the word apple into the file answer.txt.")
    ws = tmp_path / "ws"
    ws.mkdir()
    (ws / "data.txt").write_text("x\n")

    async def main():
        async with FakeOpenAIServer(lambda req: FakeReply(content=replies[req.index])) as srv:
            p = await asyncio.create_subprocess_exec(
                sys.executable, AGENT, "--task-file", str(tmp_path / "task.txt"), cwd=ws,
                env={**os.environ, "OPENAI_BASE_URL": srv.base_url, "OPENAI_API_KEY": "k"},
                stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
            out, err = await asyncio.wait_for(p.communicate(), 60)
            return p.returncode, err.decode(), [r.body for r in srv.requests]

    rc, err, bodies = asyncio.run(main())
    assert rc == 0, err
    assert (ws / "answer.txt").read_text() == "apple\n"  # DONE ended the episode before the third reply
    assert len(bodies) == 2
    first, second = bodies
    assert "Files in the current directory: data.txt" in first["messages"][1]["content"]
    assert first["max_tokens"] == 64
    # the second call re-sends the history (the first call's messages are its prefix) plus the command's output
    assert second["messages"][:2] == first["messages"]
    assert second["messages"][2] == {"role": "assistant", "content": replies[0]}
    assert "Output:\napple\nExit code: 0" in second["messages"][3]["content"]
