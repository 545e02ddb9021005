"""The workspace tools' names and schemas (what a model is offered): constants only, so task
definitions and the grader subprocess name tools without importing the sandboxed tools."""
from __future__ import annotations

# Handled by the agent loop itself, not by Workspace.
FINISH = "finish"
SPAWN_SUBAGENT = "spawn_subagent"
RUN_TESTS = "run_tests"
RUN = "run"

TOOL_SCHEMAS: dict[str, dict] = {
    "write_file": {
        "description": "Create or overwrite a file in the workspace (parent dirs are created).",
        "parameters": {
            "type": "object",
            "properties": {"path": {"type": "string"}, "content": {"type": "string"}},
            "required": ["path", "content"],
        },
    },
    "read_file": {
        "description": "Read a text file from the workspace.",
        "parameters": {"type": "object", "properties": {"path": {"type": "string"}}, "required": ["path"]},
    },
    "list_files": {
        "description": "List files under a workspace directory (recursive).",
        "parameters": {"type": "object", "properties": {"path": {"type": "string"}}, "required": []},
    },
    "run": {
        "description": "Run a shell command in the workspace; returns exit code and output.",
        "parameters": {
            "type": "object",
            "properties": {"command": {"type": "string"}, "timeout_s": {"type": "number"}},
            "required": ["command"],
        },
    },
    RUN_TESTS: {
        "description": "Run the task's test suite on the workspace (it takes seconds to tens of seconds); "
                       "returns each test's result.",
        "parameters": {"type": "object", "properties": {}, "required": []},
    },
    FINISH: {
        "description": "Finish the task; optionally report what was done.",
        "parameters": {"type": "object", "properties": {"message": {"type": "string"}}, "required": []},
    },
    SPAWN_SUBAGENT: {
        "description": "Start a sub-agent with its own context on a sub-task in the same workspace; "
                       "returns its final report.",
        "parameters": {"type": "object", "properties": {"task": {"type": "string"}}, "required": ["task"]},
    },
}
TOOL_NAMES = tuple(TOOL_SCHEMAS)
