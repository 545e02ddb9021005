"""A minimal command-line agent for small models: one shell command per turn, in a ```bash block.

configs/smol_agent.py runs it as a command harness inside every rollout's sandbox:

    python3 shell_agent.py --task-file {instruction_file} [--turns 3] [--max-tokens 64]

It talks to the OpenAI-compatible endpoint in OPENAI_BASE_URL with the key in OPENAI_API_KEY (the recording
proxy: the key ties each call to its rollout), standard library only. Each turn: the model's reply, its first
fenced code block (or its single line) run with ``bash -c`` in the working directory (the workspace), the
command's output and exit code sent back as the next user message. The episode ends when the model replies
DONE (or with no command), repeats its last command, or after ``--turns`` turns. Every call re-sends the
history, so the calls of one episode share their prefixes (a prefix-sharing tree for the trainer).
Exit 0 always once the model was reached: the workspace is then graded, whatever the agent did.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import urllib.error
import urllib.request

SYSTEM = ("You are an assistant that completes tasks in a Linux shell. Reply with exactly one bash command "
          "in a ```bash code block. When the task is done, reply DONE.")
_BLOCK = re.compile(r"```[a-zA-Z]*\n(.*?)(?:```|$)", re.S)


def command_of(reply: str) -> str | None:
    """The first fenced block's text; else a one-line reply that is not DONE; else None."""
    m = _BLOCK.search(reply)
    if m:
        cmd = m.group(1).strip()
        return cmd or None
    text = reply.strip()
    if text and "\n" not in text and text.rstrip(".").upper() != "DONE":
        return text.strip("`")
    return None


def chat(url: str, key: str, messages: list[dict], max_tokens: int, temperature: float | None) -> str:
    body = {"model": "gyre", "messages": messages, "max_tokens": max_tokens}
    if temperature is not None:
        body["temperature"] = temperature
    req = urllib.request.Request(url.rstrip("/") + "/chat/completions", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json", "Authorization": f"Bearer {key}"})
    with urllib.request.urlopen(req, timeout=float(os.environ.get("GYRE_REQUEST_TIMEOUT_S", "600"))) as r:
        return json.load(r)["choices"][0]["message"]["content"] or ""


def run(cmd: str, timeout_s: float) -> tuple[str, int]:
    try:
        p = subprocess.run(["bash", "-c", cmd], capture_output=True, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        return f"(timed out after {timeout_s:.0f} s)", 124
    out = (p.stdout + p.stderr).strip()
    return (out[-400:] if out else "(no output)"), p.returncode


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--task-file", required=True)
    ap.add_argument("--turns", type=int, default=3)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--command-timeout", type=float, default=10.0)
    ap.add_argument("--temperature", type=float, default=None, help="default: the server's (1.0)")
    args = ap.parse_args()
    with open(args.task_file) as f:
        task = f.read().strip()
    url, key = os.environ["OPENAI_BASE_URL"], os.environ.get("OPENAI_API_KEY", "none")
    files = sorted(os.listdir("."))
    listing = ", ".join(files) if files else "(empty)"
    messages = [{"role": "system", "content": SYSTEM},
                {"role": "user", "content": f"{task}\nFiles in the current directory: {listing}"}]
    last = None
    for turn in range(args.turns):
        try:
            reply = chat(url, key, messages, args.max_tokens, args.temperature)
        except (urllib.error.URLError, OSError, KeyError, ValueError) as e:
            print(f"shell_agent: model call failed: {e}", file=sys.stderr)
            return 1 if turn == 0 else 0  # never reached the model: not an episode
        messages.append({"role": "assistant", "content": reply})
        cmd = command_of(reply)
        if cmd is None or cmd == last:
            break
        last = cmd
        out, rc = run(cmd, args.command_timeout)
        print(f"$ {cmd}\n{out}\n[exit {rc}]", flush=True)
        messages.append({"role": "user", "content": f"Output:\n{out}\nExit code: {rc}\nIf the task is done, "
                                                    "reply DONE. Otherwise reply with the next command."})
    return 0


if __name__ == "__main__":
    sys.exit(main())
