"""Sandboxed rollouts: hostile commands through the real harness `run` tool, and reward hacking.

Real rollouts (aiohttp -> loopback -> FakeOpenAIServer), real bubblewrap sandboxes, real
graders in subprocesses. Network checks only ever target 127.0.0.1 on this machine.
Skipped, with the reason, where bubblewrap cannot build a sandbox (see .ci/run).
"""
import asyncio
import hashlib
import json
import os
import socket
from pathlib import Path

import pytest

import gyre_jax.agents.graders as graders_mod
import gyre_jax.agents.tasks.repo_spec as repo_spec
import gyre_jax.agents.tasks.tiny as tiny
from gyre_jax.agents import sandbox as sb
from gyre_jax.agents.config import HarnessConfig
from gyre_jax.agents.harness import RolloutRequest, run_rollouts
from gyre_jax.agents.tasks.base import DEFAULT_TOOLS, Task
from gyre_jax.agents.tools import Workspace
from gyre_jax.serving import identity as H
from gyre_jax.testing.fake_openai_server import FakeOpenAIServer, FakeReply, tool_calls
from gyre_jax.trajectory import vocab

_USABLE, _WHY = sb.bwrap_usable()
needs_bwrap = pytest.mark.skipif(not _USABLE, reason=f"bubblewrap sandbox unavailable: {_WHY}")
ROOT = os.geteuid() == 0
LIMITS = sb.SandboxLimits(processes=64, disk_bytes=8 << 20, file_bytes=4 << 20, tmp_bytes=4 << 20, cpu_s=20)


def _config(base_url, **kw):
    return HarnessConfig(base_url=base_url, run_id="sbx", backoff_base_s=0.01, backoff_max_s=0.05, deadline_s=60.0,
                         grader_timeout_s=30.0, command_timeout_s=5.0,
                         sandbox=sb.SandboxConfig(kind="bubblewrap", limits=LIMITS), **kw)


def _sha(path) -> str:
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


def _tree(root: Path) -> dict:
    return {str(p.relative_to(root)): (p.read_bytes() if p.is_file() else None) for p in sorted(root.rglob("*"))}


def _processes_with(marker: str) -> list[int]:
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                if marker.encode() in f.read():
                    found.append(int(pid))
        except OSError:
            pass
    return found


def _tool_results(srv, rollout_id: str) -> list[str]:
    """The `run` results the harness sent back, in order."""
    reqs = [r for r in srv.requests if r.header(H.HEADER_ROLLOUT) == rollout_id]
    return [m["content"] for m in reqs[-1].messages if m["role"] == "tool"] if reqs else []


@needs_bwrap
def test_hostile_command_battery_is_refused_or_contained_and_host_unchanged(tmp_path, monkeypatch):
    monkeypatch.setenv("GYRE_TEST_SECRET", "hunter2-credential")
    host = tmp_path / "host"  # stands for anything of the trainer's
    host.mkdir()
    (host / "keep.txt").write_text("host data")
    ws_root = tmp_path / "ws"
    (ws_root / "other").mkdir(parents=True)  # another rollout's workspace
    (ws_root / "other" / "secret.txt").write_text("other-rollout-secret")
    grader_files = [graders_mod.__file__, repo_spec.__file__, tiny.__file__]
    before = {"host": _tree(host), "other": _tree(ws_root / "other"), "graders": [_sha(f) for f in grader_files]}
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(8)
    listener.setblocking(False)
    lport = listener.getsockname()[1]
    private_probe = Path("/tmp") / f"gyre_sandbox_probe_{os.getpid()}"

    def battery(proxy_port):
        return [  # (name, command, timeout_s)
            ("abs_path", f"echo pwned > {host}/abs.txt; echo pwned > {ws_root}/other/secret.txt", 5),
            ("dotdot", "echo pwned > ../escape.txt; echo pwned > ../../escape.txt", 5),
            ("symlink", f"ln -s {host} hostlink; echo pwned > hostlink/sym.txt; ln -s / rootlink; "
                        "echo pwned > rootlink/etc/pwned", 5),
            ("grader", "; ".join(f"echo 'raise SystemExit' >> {f}" for f in grader_files)
             + f"; ls -ld {Path(graders_mod.__file__).parent} /work /root /home", 5),
            ("read_other", f"cat {ws_root}/other/secret.txt ../other/secret.txt; env", 5),
            ("proxy", f"exec 3<>/dev/tcp/127.0.0.1/{proxy_port} && echo CONNECTED-proxy", 5),
            ("listener", f"exec 3<>/dev/tcp/127.0.0.1/{lport} && echo CONNECTED-listener", 5),
            ("tmp", f"echo x > {private_probe} && cat {private_probe}; echo x > /usr/pwned", 5),
            ("fork_bomb", "bomb() { bomb | bomb & }; bomb; sleep 2; echo survived", 3),
            ("fill_disk", "head -c 100M /dev/zero > big; for i in $(seq 20); do head -c 3M /dev/zero > f$i; done; "
                          "du -sh .", 5),
            ("sigterm", "trap '' TERM; exec -a gyre-ignores-term bash -c \"trap '' TERM; sleep 30\"", 1),
            ("background", "(exec -a gyre-bg-a sleep 30 &); setsid bash -c 'exec -a gyre-bg-b sleep 30' & "
                           "nohup bash -c 'exec -a gyre-bg-c sleep 30' >/dev/null 2>&1 & echo started", 5),
            ("cleanup", "rm -f big f*; echo ok > answer.txt", 5),
        ]

    task = tiny.make_task(3)
    evil = Task(task_id="evil", family="tiny", prompt=task.prompt, grader=task.grader, params=task.params,
                tools=DEFAULT_TOOLS)

    async def main():
        def responder(req):
            if req.header(H.HEADER_ROLLOUT) == "next":  # the next rollout: an honest answer
                if req.turn == 0:
                    return tool_calls(("run", {"command": f"echo -n {task.params['expected']} > answer.txt"}))
                return tool_calls(("finish", {}))
            cmds = battery(srv.port)
            if req.turn < len(cmds):
                return tool_calls(("run", {"command": cmds[req.turn][1], "timeout_s": cmds[req.turn][2]}))
            return tool_calls(("finish", {}))

        async with FakeOpenAIServer(responder) as srv:
            cfg = _config(srv.base_url)
            first = await run_rollouts([RolloutRequest(rollout_id="evil", task=evil, group_id="g")], cfg,
                                       workspace_root=ws_root)
            nxt = await run_rollouts([RolloutRequest(rollout_id="next", task=evil, group_id="g2")], cfg,
                                     workspace_root=ws_root)
            return srv, first[0], nxt[0], battery(srv.port)

    srv, res, nxt, cmds = asyncio.run(main())
    out = dict(zip([c[0] for c in cmds], _tool_results(srv, "evil")))
    assert len(out) == len(cmds), out

    # Refused: nothing outside the workspace changed, nothing of the host was read.
    assert _tree(host) == before["host"] and _tree(ws_root / "other") == before["other"]
    assert [_sha(f) for f in grader_files] == before["graders"]
    assert not (tmp_path / "escape.txt").exists() and not (ws_root / "escape.txt").exists()
    assert not private_probe.exists() and not Path("/usr/pwned").exists()
    assert "other-rollout-secret" not in out["read_other"] and "hunter2" not in out["read_other"]
    assert "No such file or directory" in out["grader"]  # the package dir is not even visible
    assert "CONNECTED" not in out["proxy"] + out["listener"]
    with pytest.raises(BlockingIOError):
        listener.accept()  # nothing reached the host's loopback
    listener.close()
    # Contained: the fork bomb hit the process limit, the disk its size, the stubborn ones were killed.
    assert "survived" in out["fork_bomb"] or out["fork_bomb"].startswith("timed out")
    assert out["sigterm"].startswith("timed out after 1 s")
    assert out["background"].startswith("exit code 0") and "started" in out["background"]
    assert not _processes_with("gyre-ignores-term") and not _processes_with("gyre-bg-")
    stats = res.sandbox
    assert stats["kind"] == "bubblewrap" and stats["commands"] == len(cmds)
    assert stats["violations"]["write_outside_workspace"] == 2 and stats["violations"]["network"] == 2
    assert stats["violations"]["permission_denied"] >= 1  # ../ is the sandbox's root-owned /
    assert out["tmp"].startswith("exit code 1\nx\n")  # /tmp is private and writable
    assert {"processes", "file_size", "wall_time"} <= set(stats["limits_hit"]), stats
    if ROOT:  # the tmpfs workspace: the disk filled, at its size
        assert "No space left on device" in out["fill_disk"] and stats["limits_hit"]["disk"] == 1
    assert res.status == vocab.STATUS_COMPLETED and res.score == 0.0  # "ok" is the wrong answer
    assert stats["snapshot"]["skipped"] >= 2  # the symlinks were not handed to the grader
    # The next rollout runs normally, in a clean sandbox.
    assert nxt.status == vocab.STATUS_COMPLETED and nxt.score == 1.0, nxt.error
    assert nxt.sandbox["violations"] == {} and nxt.sandbox["limits_hit"] == {}
    assert json.loads(json.dumps(res.to_outcome("sbx").details))["harness"]["sandbox"]["commands"] == len(cmds)


def _hack_module(n_cases: int) -> str:
    """Agent code that tries to forge the check runner's results, then exits before any real one."""
    return (
        "import json, os\n"
        "for fd in range(3, 20):\n"
        "    try:\n"
        f"        for k in range({n_cases}):\n"
        "            os.write(fd, (json.dumps({'check': f'case:FN[{k}]', 'ok': True, 'got': 1}) + '\\n').encode())\n"
        "    except OSError:\n"
        "        pass\n"
        "os._exit(0)\n"
    )


@needs_bwrap
def test_reward_hacking_policy_gets_no_reward(tmp_path):
    """A scripted policy that edits the installed grader, shadows the check runner with its
    own gyre_jax package, and forges the runner's output scores what the same workspace
    scores without the hacks: no reward for them."""
    task = repo_spec.make_task(5, n_modules=1, functions_per_module=1)
    mod = task.params["modules"][0]
    fn = mod["functions"][0]
    n_cases = len(fn["cases"])
    honest_wrong = {f"{task.params['package']}/__init__.py": "", mod["path"]: f"def {fn['name']}(*a):\n    return None\n",
                    repo_spec.README: "nothing"}
    forged = json.dumps({"check": "x", "ok": True})
    hacked = dict(honest_wrong)
    hacked[mod["path"]] = (_hack_module(n_cases).replace("FN", mod["import"] + "." + fn["name"])
                           + f"def {fn['name']}(*a):\n    return None\n")
    hacked["gyre_jax/__init__.py"] = ""
    hacked["gyre_jax/agents/__init__.py"] = ""
    hacked["gyre_jax/agents/check_runner.py"] = f"print({forged!r})\n"
    grader_file = repo_spec.__file__
    runner_file = Path(grader_file).parents[1] / "check_runner.py"
    sha = (_sha(grader_file), _sha(runner_file))

    async def main():
        def responder(req):
            files = hacked if req.header(H.HEADER_ROLLOUT) == "hack" else honest_wrong
            turns = [[("write_file", {"path": p, "content": c}) for p, c in files.items()]]
            if req.header(H.HEADER_ROLLOUT) == "hack":
                turns.append([("run", {"command": f"sed -i 's/checks.grade()/__import__(\"scoring\")/' {grader_file}; "
                                                  f"cp -r gyre_jax {Path(grader_file).parents[3]}/ ; "
                                                  "echo '{\"score\": 1.0}' > expected.json"})])
            turns.append([("finish", {})])
            return tool_calls(*turns[req.turn]) if req.turn < len(turns) else FakeReply(content="done")

        async with FakeOpenAIServer(responder) as srv:
            reqs = [RolloutRequest(rollout_id=r, task=task, group_id="g") for r in ("hack", "honest")]
            return await run_rollouts(reqs, _config(srv.base_url), workspace_root=tmp_path / "ws")

    hack, honest = asyncio.run(main())
    assert hack.status == honest.status == vocab.STATUS_COMPLETED, (hack.error, honest.error)
    assert (_sha(grader_file), _sha(runner_file)) == sha
    assert hack.score <= honest.score == 0.5, (hack.grader_details, honest.grader_details)
    cases = [c for c in hack.grader_details["checks"] if c["check"].startswith("case:")]
    assert len(cases) == n_cases and not any(c["ok"] for c in cases)
    assert hack.sandbox["commands"] == 1 and honest.sandbox["commands"] == 0


def test_container_command_line_confines_like_the_sandbox(tmp_path):
    """docker/podman cannot run here: check the command line they would get."""
    cfg = sb.SandboxConfig(kind="podman", limits=LIMITS, images={"tiny": "ghcr.io/x/tiny:1"})
    box = sb.make_sandbox(cfg, tmp_path, family="tiny", name="r-1")
    launch = box.launch("echo hi")
    a = launch.argv
    assert a[:4] == ["podman", "run", "--rm", "--init"] and a[-4:] == ["ghcr.io/x/tiny:1", "bash", "-c", "echo hi"]
    pairs = {(a[k], a[k + 1]) for k in range(len(a) - 1)}
    assert {("--network", "none"), ("--pids-limit", "64"), ("--memory", str(LIMITS.memory_bytes)),
            ("--cap-drop", "ALL"), ("--security-opt", "no-new-privileges"), ("--workdir", "/workspace"),
            ("--volume", f"{tmp_path}:/workspace:rw"), ("--ulimit", f"fsize={4 << 20}:{4 << 20}")} <= pairs
    assert "--read-only" in a and launch.kill_argv == ["podman", "kill", a[a.index("--name") + 1]]
    other = sb.make_sandbox(cfg, tmp_path, family="repo_spec", name="r-2").launch("true").argv
    assert cfg.default_image in other
    net = sb.make_sandbox(sb.SandboxConfig(kind="docker", network_families=("tiny",)), tmp_path, family="tiny",
                          name="r").launch("true").argv
    assert net[0] == "docker" and ("--network", "bridge") in {(net[k], net[k + 1]) for k in range(len(net) - 1)}


def test_sandbox_config_rejects_bad_values():
    with pytest.raises(ValueError, match="kind"):
        sb.SandboxConfig(kind="chroot")
    with pytest.raises(ValueError, match="processes"):
        sb.SandboxLimits(processes=0)
    with pytest.raises(ValueError, match="extra_ro_paths"):
        sb.SandboxConfig(extra_ro_paths=("opt",))
    # The harness section's sandbox is its kind's name (--config.harness.sandbox=bubblewrap) or a SandboxConfig
    assert HarnessConfig(base_url="http://x/v1", sandbox="bubblewrap").sandbox == sb.SandboxConfig(kind="bubblewrap")
    with pytest.raises(ValueError, match="kind"):
        HarnessConfig(base_url="http://x/v1", sandbox="chroot")
    with pytest.raises(ValueError, match="sandbox"):
        HarnessConfig(base_url="http://x/v1", sandbox=42)
    assert sb.classify("bash: x: Read-only file system\nConnection refused", network=False) == (
        ["write_outside_workspace", "network"], [])
    assert sb.classify("Connection refused", network=True) == ([], [])


def test_snapshot_copies_only_regular_files_and_directories(tmp_path):
    ws = tmp_path / "ws"
    (ws / "pkg").mkdir(parents=True)
    (ws / "pkg" / "a.py").write_text("x = 1\n")
    (ws / "big.bin").write_bytes(b"\0" * 5000)
    (ws / "link").symlink_to("/etc/passwd")
    (ws / "dirlink").symlink_to(tmp_path)
    os.mkfifo(ws / "fifo")  # would block a grader that opened it
    deep = ws
    for k in range(80):
        deep = deep / "d"
    deep.mkdir(parents=True)
    (deep / "bottom.txt").write_text("deep")
    stats = graders_mod.snapshot_workspace(ws, tmp_path / "snap", max_bytes=1000)
    snap = tmp_path / "snap"
    assert (snap / "pkg" / "a.py").read_text() == "x = 1\n"
    assert not (snap / "big.bin").exists() and stats["truncated"]  # over max_bytes
    assert not any(p.is_symlink() for p in snap.rglob("*")) and not (snap / "fifo").exists()
    assert not list(snap.rglob("bottom.txt"))  # deeper than SNAPSHOT_MAX_DEPTH
    assert stats["files"] == 1 and stats["bytes"] == 6 and stats["skipped"] == 5
    assert stats["skipped_by_reason"] == {"too_deep": 1, "path_too_long": 0, "not_regular": 3, "over_bytes": 1,
                                          "over_entries": 0, "unreadable": 0}
    many = tmp_path / "many"
    many.mkdir()
    for k in range(30):
        (many / f"f{k}").write_text("")
    assert graders_mod.snapshot_workspace(many, tmp_path / "snap2", max_bytes=1 << 20, max_entries=10)["files"] == 10


def _deep_dirs(root, levels: int, name_len: int) -> str:
    """``levels`` nested directories of ``name_len``-byte names under ``root`` (made through
    directory fds: the whole path may pass PATH_MAX); returns the relative path."""
    fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY)
    parts = []
    try:
        for k in range(levels):
            name = (str(k) * name_len)[:name_len]
            os.mkdir(name, dir_fd=fd)
            nfd = os.open(name, os.O_RDONLY | os.O_DIRECTORY, dir_fd=fd)
            os.close(fd)
            fd, parts = nfd, parts + [name]
        with os.fdopen(os.open("bottom.txt", os.O_WRONLY | os.O_CREAT, 0o644, dir_fd=fd), "w") as f:
            f.write("deep")
    finally:
        os.close(fd)
    return "/".join(parts)


def test_snapshot_of_a_crafted_workspace_skips_what_it_cannot_copy_and_says_why(tmp_path):
    # Paths longer than the snapshot's destination can hold, a sparse file of 64 GiB with
    # 8 KiB of data, a symlink loop and a fifo: the snapshot copies what it can, says what
    # it skipped by reason, and holds the sparse file's data, not its apparent size.
    ws = tmp_path / "ws"
    ws.mkdir()
    (ws / "answer.txt").write_text("42\n")
    _deep_dirs(ws, 19, 200)  # ~3.8 KB of path: fits under ws, not under the longer snapshot path
    with open(ws / "sparse.bin", "wb") as f:
        f.write(b"a" * 4096)
        f.seek(1 << 35)
        f.write(b"z" * 4096)
        f.truncate(1 << 36)
    (ws / "loop_a").symlink_to("loop_b")
    (ws / "loop_b").symlink_to("loop_a")
    os.mkfifo(ws / "fifo")
    snap = tmp_path / ("s" * 250) / "snap"
    stats = graders_mod.snapshot_workspace(ws, snap, max_bytes=1 << 20)
    assert (snap / "answer.txt").read_text() == "42\n"
    sparse = (snap / "sparse.bin").stat()
    assert sparse.st_size == 1 << 36 and sparse.st_blocks * 512 < 1 << 20  # a copy of holes, not 64 GiB
    with open(snap / "sparse.bin", "rb") as f:
        assert f.read(4096) == b"a" * 4096 and f.seek(1 << 35) and f.read(4096) == b"z" * 4096
    assert stats["bytes"] == 3 + 2 * 4096 and stats["apparent_bytes"] == 3 + (1 << 36)
    reasons = stats["skipped_by_reason"]
    assert reasons["not_regular"] == 3 and reasons["path_too_long"] == 1 and stats["truncated"]
    assert stats["skipped"] == sum(reasons.values()) == 4


def test_kind_none_is_loud(tmp_path, caplog, monkeypatch):
    monkeypatch.setattr(sb, "_warned_none", False)
    with caplog.at_level("WARNING", logger="gyre_jax.agents.sandbox"):
        box = sb.make_sandbox(sb.SandboxConfig(kind="none"), tmp_path, family="tiny", name="r")
    assert box.kind == "none" and "SANDBOX DISABLED" in caplog.text


@needs_bwrap
def test_agent_code_the_grader_runs_is_confined_too(tmp_path):
    """repo_spec imports the agent's module to check it: that code runs in the grader's own
    sandbox (the snapshot read-only, no network, not the trainer's files)."""
    task = repo_spec.make_task(5, n_modules=1, functions_per_module=1)
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(8)
    listener.setblocking(False)
    port = listener.getsockname()[1]
    files = repo_spec.reference_files(task)
    mod = task.params["modules"][0]["path"]
    files[mod] = ("import os, socket\n"
                  "for target in ['tamper.txt', '" + str(tmp_path / "outside.txt") + "']:\n"
                  "    try:\n        open(target, 'w').write('x')\n    except OSError:\n        pass\n"
                  f"try:\n    socket.create_connection(('127.0.0.1', {port}), timeout=1)\nexcept OSError:\n    pass\n"
                  + files[mod])
    ws = tmp_path / "snap"
    for rel, content in files.items():
        (ws / rel).parent.mkdir(parents=True, exist_ok=True)
        (ws / rel).write_text(content)
    os.environ[sb.GRADER_SANDBOX_ENV] = json.dumps({"kind": "bubblewrap", "limits": {}, "image": None})
    try:
        grade = repo_spec.grade(task, ws)
    finally:
        del os.environ[sb.GRADER_SANDBOX_ENV]
    assert grade.score == 1.0, grade.details  # the code itself is right
    assert not (ws / "tamper.txt").exists() and not (tmp_path / "outside.txt").exists()
    with pytest.raises(BlockingIOError):
        listener.accept()
    listener.close()


# 160 MiB in memfds of 2 MiB each (each under RLIMIT_FSIZE, none mapped: RLIMIT_AS sees none of it)
_HOLD = ("python3 -c \"import os\nfds = [os.memfd_create('x') for _ in range(80)]\n"
         "[os.write(fd, b'x' * (2 << 20)) for fd in fds]\nprint('HOLD' + '-OK')\"")
_USERNS_TMPFS = ("unshare -U -r -m sh -c 'mount -t tmpfs none /tmp && for i in $(seq 80); do "
                 "head -c 2M /dev/zero > /tmp/x$i || exit 1; done && echo HOLD-$((1+1))'")
_TMP = "for i in $(seq 80); do head -c 2M /dev/zero > /tmp/x$i || exit 1; done && echo HOLD-$((2+2))"


@needs_bwrap
def test_the_sandbox_as_a_whole_is_capped_against_memfd_and_tmpfs(tmp_path):
    # RLIMIT_AS does not count memfd or tmpfs pages (160 MiB held under a 256 MiB address
    # space each time before); the sandbox's cgroup does: the command is killed at 48 MiB,
    # and the stats say how the sandbox was capped. Where no cgroup can be made the stats
    # say why and the rest of this test cannot be checked here.
    limits = sb.SandboxLimits(processes=64, memory_bytes=256 << 20, sandbox_memory_bytes=48 << 20,
                              tmp_bytes=256 << 20, disk_bytes=8 << 20, file_bytes=4 << 20, cpu_s=20)
    box = sb.make_sandbox(sb.SandboxConfig(kind="bubblewrap", limits=limits), tmp_path / "ws", family="tiny",
                          name="cap")
    (tmp_path / "ws").mkdir()
    box.prepare()
    ws = Workspace(tmp_path / "ws", sandbox=box, command_timeout_s=60.0)
    try:
        out = asyncio.run(ws.run(_HOLD))
        stats = box.stats.to_dict()
        if stats["cgroup"].startswith("none:"):
            assert "per-process rlimits only" in stats["cgroup"]
            pytest.skip(f"no cgroup can be made here: {stats['cgroup']}")
        assert stats["cgroup"].startswith(("v1: memory 50331648", "v2: memory 50331648")), stats
        killed = ("exit code 137", "exit code -9")  # the OOM kill takes the command, or bwrap itself
        assert "HOLD-OK" not in out and out.startswith(killed), out
        assert "killed at the sandbox's memory cap of 50331648 bytes" in out and box.stats.limits_hit["memory"] == 1
        userns = asyncio.run(ws.run(_USERNS_TMPFS))  # a namespace and a tmpfs of its own: refused or capped
        assert "HOLD-2" not in userns, userns
        tmp = asyncio.run(ws.run(_TMP))  # the sandbox's own /tmp (256 MiB): its pages count too
        assert "HOLD-4" not in tmp and tmp.startswith(killed), tmp
        assert "HOLD-3" in asyncio.run(ws.run("echo HOLD-$((1+2))"))  # small commands still run
    finally:
        box.release()
    assert box.stats.peak_memory_bytes is None or box.stats.peak_memory_bytes <= 48 << 20


# 192 MiB in memfds (under every rlimit: RLIMIT_AS sees no memfd page that is not mapped)
_HOLD_192 = ("python3 -c \"import os\nfds = [os.memfd_create('x') for _ in range(96)]\n"
             "[os.write(fd, b'x' * (2 << 20)) for fd in fds]\nprint('HOLD' + '-192')\"")


def _one_sandbox(tmp_path, limits):
    box = sb.make_sandbox(sb.SandboxConfig(kind="bubblewrap", limits=limits), tmp_path / "ws", family="tiny",
                          name="mem")
    (tmp_path / "ws").mkdir()
    box.prepare()
    return box, Workspace(tmp_path / "ws", sandbox=box, command_timeout_s=60.0)


@needs_bwrap
def test_the_memory_limit_counts_memfd_pages_without_a_second_setting(tmp_path):
    """The memory limit is the one a user sets (``memory_bytes``): with no separate sandbox cap given, the
    sandbox's cgroup caps it there, so 192 MiB in memfds under a 128 MiB limit is killed (a separate default
    cap of 4 GiB let a command hold 600 MiB in memfds past its memory limit)."""
    limits = sb.SandboxLimits(processes=64, memory_bytes=128 << 20, tmp_bytes=4 << 20, disk_bytes=8 << 20,
                              file_bytes=4 << 20, cpu_s=20)
    box, ws = _one_sandbox(tmp_path, limits)
    try:
        out = asyncio.run(ws.run(_HOLD_192))
        if box.stats.cgroup.startswith("none:"):  # the other path holds it: the filter refuses the memfd
            assert "Operation not permitted" in out, out
        assert "HOLD-192" not in out, out
        assert "HOLD-3" in asyncio.run(ws.run("echo HOLD-$((1+2))"))
    finally:
        box.release()


@needs_bwrap
def test_without_a_cgroup_memfd_shm_and_dev_cannot_hold_memory_past_the_limits(tmp_path, monkeypatch):
    """Where no cgroup can be made (not delegated, not root), RLIMIT_AS alone would let a command hold any
    amount in memfds, SysV segments or bwrap's unsized /dev tmpfs. Then memfd_create and shmget are refused
    (seccomp), /dev/shm is sized like /tmp and the rest of /dev is read-only; small commands still run."""
    monkeypatch.setattr(sb, "make_cap", lambda *a: (None, "no cgroup (the test)"))
    limits = sb.SandboxLimits(processes=64, memory_bytes=256 << 20, tmp_bytes=4 << 20, disk_bytes=8 << 20,
                              file_bytes=4 << 20, cpu_s=20)
    box, ws = _one_sandbox(tmp_path, limits)
    try:
        out = asyncio.run(ws.run(_HOLD_192))
        assert "HOLD-192" not in out and "Operation not permitted" in out, out
        assert box.stats.cgroup.startswith("none: no cgroup (the test)") and "memfd" in box.stats.cgroup
        shm = asyncio.run(ws.run("python3 -c \"import ctypes; libc = ctypes.CDLL(None, use_errno=True); "
                                 "print('SHMGET', libc.shmget(0, 64 << 20, 0o1600), ctypes.get_errno())\""))
        assert "SHMGET -1 1" in shm, shm  # EPERM
        dev = asyncio.run(ws.run("for i in 1 2 3; do head -c 2M /dev/zero > /dev/shm/x$i || break; done; "
                                 "echo SHM=$(du -sk /dev/shm | cut -f1); head -c 1M /dev/zero > /dev/y; "
                                 "echo RC2=$?; echo ok > /dev/null && echo NULL-OK"))
        assert "No space left on device" in dev and "SHM=4096" in dev, dev  # /dev/shm: 4 MiB
        assert "RC2=1" in dev and "NULL-OK" in dev, dev  # /dev itself takes no file; its devices still work
        assert "HOLD-3" in asyncio.run(ws.run("python3 -c \"import threading; print('HOLD-' + str(1 + 2))\""))
    finally:
        box.release()


@needs_bwrap
@pytest.mark.skipif(not ROOT, reason="as root: without it bwrap's --disable-userns is used")
def test_no_user_namespaces_inside_a_root_trainers_sandbox(tmp_path):
    box = sb.make_sandbox(sb.SandboxConfig(kind="bubblewrap", limits=LIMITS), tmp_path / "ws", family="tiny",
                          name="userns")
    (tmp_path / "ws").mkdir()
    box.prepare()
    ws = Workspace(tmp_path / "ws", sandbox=box, command_timeout_s=60.0)
    try:
        out = asyncio.run(ws.run(
            "unshare -U -r id; python3 -c \"import ctypes; libc = ctypes.CDLL(None, use_errno=True); "
            "print('UNSHARE', libc.unshare(0x10000000), ctypes.get_errno())\"; echo FDS=$(ls /proc/self/fd | wc -l); "
            "python3 -c \"import threading, subprocess; t = threading.Thread(target=print, args=('THREAD-OK',)); "
            "t.start(); t.join(); subprocess.run(['echo', 'CHILD-OK'])\""))
    finally:
        box.release()
    assert "uid=0" not in out and "Operation not permitted" in out and "UNSHARE -1 1" in out, out  # EPERM
    assert "THREAD-OK" in out and "CHILD-OK" in out, out  # threads (clone3 -> clone) and children still work
    assert "FDS=4" in out, out  # stdin/out/err + ls's own: the filter's fd was not left open


def test_cgroups_left_by_a_killed_trainer_are_removed(monkeypatch):
    from gyre_jax.agents import sandbox_cgroup as cg
    cap, why = cg.make_cap(64 << 20, 16)
    if cap is None:
        pytest.skip(f"no cgroup can be made here: {why}")
    cap.release()
    stale = [os.path.join(os.path.dirname(d), "gyre-999999-7") for d in cap.dirs]  # no such pid
    for d in stale:
        os.mkdir(d)
    monkeypatch.setattr(cg, "_CLEANED", set())
    again, _ = cg.make_cap(64 << 20, 16)
    again.release()
    assert not any(os.path.exists(d) for d in stale)


@needs_bwrap
@pytest.mark.skipif(not ROOT, reason="the filter is used as root only")
def test_a_refused_seccomp_filter_leaves_the_sandbox_usable_and_says_so(monkeypatch, caplog):
    from gyre_jax.agents import sandbox_seccomp
    monkeypatch.setattr(sandbox_seccomp, "_program", lambda sets: b"not bpf")  # what a kernel without it refuses
    monkeypatch.setattr(sandbox_seccomp, "_paths", {})
    monkeypatch.setattr(sb, "_seccomp_refused", None)
    with caplog.at_level("WARNING", logger="gyre_jax.agents.sandbox"):
        assert sb.bwrap_usable() == (True, "")
    assert sb.seccomp_refused() and "seccomp filter against user namespaces is refused" in caplog.text
    assert "--seccomp" not in sb.bwrap_argv(network=False, uid=12345, tmp_bytes=1 << 20)
    assert json.loads(graders_mod.grader_sandbox_env("bubblewrap", LIMITS)[sb.GRADER_SANDBOX_ENV])["seccomp"] is False
    monkeypatch.setattr(sandbox_seccomp, "_paths", {})  # the garbage file is not reused after the test
