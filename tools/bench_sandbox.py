"""What the rollout sandbox costs: per tool command, per rollout, and on the RL demo.

    python tools/bench_sandbox.py [--commands 200] [--rollouts 32] [--rounds 4] [--cap-mib 64]

``--rounds 0`` skips the end-to-end rollouts (per command, per rollout and the cap only).

1. Per command: ``Workspace.run("true")`` (the harness's real `run` path: asyncio subprocess,
   output capture, stats) with no sandbox against a bubblewrap sandbox, interleaved so load
   drift hits both; medians. ``overhead_per_command_ms`` is the difference.
2. Per rollout (interleaved rounds, median): full harness rollouts (aiohttp -> FakeOpenAIServer on 127.0.0.1 -> scripted
   replies, workspace, snapshot, grader subprocess) with sandbox kind none vs bubblewrap, for
   the demo's family ('tiny': write_file + finish, no command: no uid or tmpfs is set up) and
   for 'repo_spec' (one `run` command, its grader running agent code in a sandbox too).
3. The per-sandbox memory cap: 160 MiB held in memfds (each under RLIMIT_FSIZE, none mapped,
   so RLIMIT_AS sees none of it) and in a tmpfs of a user namespace of the command's own,
   in a sandbox capped at ``--cap-mib``: held or killed, and how the sandbox was capped
   (its cgroup, or why none could be made).
4. The RL demo (configs/demo.py: 60 steps x 64 'tiny' rollouts, 367 s measured on a quiet
   machine): the added per-rollout time x rollouts, serialized (an upper bound: rollouts
   overlap each other and training), as a fraction of the demo's wall time. The measured
   comparison, for a quiet machine:

       python -m launch.main --config configs/demo.py --workdir /tmp/gyre_sbx --config.harness.sandbox=bubblewrap
       python -m launch.main --config configs/demo.py --workdir /tmp/gyre_nosbx --config.harness.sandbox=none

   and compare ``wall_s`` in the two summary.json files (needs ``sandbox="auto"`` in
   configs/demo.py's harness section for the override to be accepted).

Prints a table, then ONE JSON line.
"""
from __future__ import annotations

import asyncio
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from gyre_jax.agents import sandbox as sb  # noqa: E402
from gyre_jax.agents.agent import tool_call_message  # noqa: E402
from gyre_jax.agents.config import HarnessConfig  # noqa: E402
from gyre_jax.agents.graders import snapshot_workspace  # noqa: E402
from gyre_jax.agents.harness import RolloutRequest, run_rollouts  # noqa: E402
from gyre_jax.agents.tasks import repo_spec, solution_turns, tiny  # noqa: E402
from gyre_jax.agents.tools import Workspace  # noqa: E402
from gyre_jax.testing.fake_openai_server import FakeOpenAIServer, FakeReply  # noqa: E402

import benchkit  # noqa: E402 (tools/, beside this script)

DEMO_WALL_S = 367.0  # configs/demo.py, elastic, measured Dec 1 2026 (quiet machine)
DEMO_ROLLOUTS = 60 * 64


async def _command_ms(n: int, root: Path) -> tuple[float, float, float]:
    """Medians in ms of `true` with no sandbox, bubblewrap with its cgroup, bubblewrap without one."""
    plain = Workspace(root / "plain", sandbox=None)
    (root / "plain").mkdir()
    boxes, spaces = [], []
    for name, capped in (("boxed", True), ("nocap", False)):
        box = sb.make_sandbox(sb.SandboxConfig(kind="bubblewrap"), root / name, family="bench", name=name)
        (root / name).mkdir()
        box.prepare()
        if not capped:  # as if no cgroup could be made: the command is not wrapped
            box.stats.cgroup = "none: not made (bench)"
        boxes.append(box)
        spaces.append(Workspace(root / name, sandbox=box))
    try:
        times = [[], [], []]
        for k in range(n + 5):
            for ws, acc in zip((plain, *spaces), times):
                with benchkit.Stopwatch() as sw:
                    out = await ws.run("true")
                dt = sw.s
                assert out.startswith("exit code 0"), out
                if k >= 5:  # warm-up: page cache, first exec
                    acc.append(dt * 1e3)
            if k and k % 50 == 0:
                print(f"  commands: {k}/{n}", flush=True)
    finally:
        for box in boxes:
            box.release()
    return tuple(benchkit.median(t) for t in times)


_MEMFD = ("python3 -c \"import os\nfds = [os.memfd_create('x') for _ in range(80)]\n"
          "[os.write(fd, b'x' * (2 << 20)) for fd in fds]\nprint('HOLD' + '-OK')\"")
_USERNS_TMPFS = ("unshare -U -r -m sh -c 'mount -t tmpfs none /tmp && for i in $(seq 80); do "
                 "head -c 2M /dev/zero > /tmp/x$i || exit 1; done && echo HOLD-$((1+1))'")


async def _cap_check(root: Path, cap_mib: int) -> dict:
    """Whether 160 MiB held in memfds / a user namespace's tmpfs survives a sandbox capped at ``cap_mib``."""
    limits = sb.SandboxLimits(memory_bytes=256 << 20, sandbox_memory_bytes=cap_mib << 20, tmp_bytes=256 << 20)
    (root / "cap").mkdir()
    box = sb.make_sandbox(sb.SandboxConfig(kind="bubblewrap", limits=limits), root / "cap", family="bench",
                          name="cap")
    box.prepare()
    ws = Workspace(root / "cap", sandbox=box, command_timeout_s=120.0)
    try:
        memfd = "HOLD-OK" in await ws.run(_MEMFD)
        userns = "HOLD-2" in await ws.run(_USERNS_TMPFS)
    finally:
        box.release()
    return {"cgroup": box.stats.cgroup, "memfd_160mib_held": memfd, "userns_tmpfs_160mib_held": userns,
            "peak_memory_bytes": box.stats.peak_memory_bytes}


def _fixed_ms(n: int, root: Path) -> tuple[float, float]:
    """(prepare + release of a rollout's sandbox: uid, tmpfs mount/umount as root; snapshot of a
    one-file workspace as the grader gets it), medians in ms."""
    prep, snap = [], []
    for k in range(n):
        ws = root / f"fixed-{k}"
        ws.mkdir()
        with benchkit.Stopwatch() as made:
            box = sb.make_sandbox(sb.SandboxConfig(kind="bubblewrap"), ws, family="bench", name="b")
            box.prepare()
            Workspace(ws, sandbox=box).write_file("answer.txt", "cba")
        _, snap_s = benchkit.timed(snapshot_workspace, ws, root / f"snap-{k}", max_bytes=1 << 20)
        _, release_s = benchkit.timed(box.release)
        prep.append((made.s + release_s) * 1e3)
        snap.append(snap_s * 1e3)
    return benchkit.median(prep), benchkit.median(snap)


async def _rollouts_ms(kind: str, task, n: int, root: Path, tag: str) -> float:
    turns = solution_turns(task)

    def responder(req):
        if req.turn < len(turns):
            return FakeReply(**_reply(tool_call_message(turns[req.turn], text_format=True)))
        return FakeReply(content="done")

    async with FakeOpenAIServer(responder) as srv:
        cfg = HarnessConfig(base_url=srv.base_url, run_id="bench", concurrency=8, grader_concurrency=2,
                            send_tools_schema=False, sandbox=sb.SandboxConfig(kind=kind))
        reqs = [RolloutRequest(rollout_id=f"{kind}-{k}", task=task, group_id="g") for k in range(n)]
        with benchkit.Stopwatch() as sw:
            results = await run_rollouts(reqs, cfg, workspace_root=root / f"{tag}-{kind}-{task.family}")
        dt = sw.s
    bad = [r for r in results if r.score != 1.0]
    if bad:
        raise SystemExit(f"bench: {len(bad)} {kind} rollouts did not score 1: {bad[0].status} {bad[0].error} "
                         f"{bad[0].grader_details}")
    return dt / n * 1e3


def _reply(msg: dict) -> dict:
    return {"content": msg.get("content") or "", "tool_calls": msg.get("tool_calls")}


def main(argv=None) -> dict:
    bench = benchkit.Bench(__file__, __doc__, quick=dict(commands=3, fixed=3, rollouts=2, rounds=1, warmup_rollouts=1))
    ap = bench.parser
    ap.add_argument("--commands", type=int, default=200, help="commands per mode")
    ap.add_argument("--rollouts", type=int, default=32, help="rollouts per mode, family and round")
    ap.add_argument("--rounds", type=int, default=4, help="interleaved rounds (median); 0: no end-to-end rollouts")
    ap.add_argument("--cap-mib", type=int, default=64, help="the sandbox memory cap for the cap check")
    ap.add_argument("--fixed", type=int, default=200, help="sandbox prepare/release and snapshot samples")
    ap.add_argument("--warmup-rollouts", type=int, default=8, help="untimed rollouts per family first")
    args = bench.parse(argv)
    ok, why = sb.bwrap_usable()
    if not ok:
        raise SystemExit(f"bench_sandbox: {why}")
    with tempfile.TemporaryDirectory(prefix="gyre_bench_sbx_") as tmp:
        root = Path(tmp)
        print(f"per command: {args.commands} x `true` through Workspace.run, interleaved", flush=True)
        cmd_none, cmd_bwrap, cmd_nocap = asyncio.run(_command_ms(args.commands, root))
        prep_ms, snap_ms = _fixed_ms(args.fixed, root)
        cap = asyncio.run(_cap_check(root, args.cap_mib))
        rows = {}
        for family, task in (("tiny", tiny.make_task(1)), ("repo_spec", repo_spec.make_task(1, n_modules=1))):
            if args.rounds == 0:
                break
            asyncio.run(_rollouts_ms("none", task, args.warmup_rollouts, root / "warmup", f"warm-{family}"))  # imports, first grader
            times = {"none": [], "bubblewrap": []}
            for r in range(args.rounds):  # interleaved rounds: load drift hits both kinds
                for kind in ("none", "bubblewrap") if r % 2 == 0 else ("bubblewrap", "none"):
                    times[kind].append(asyncio.run(_rollouts_ms(kind, task, args.rollouts, root, f"r{r}")))
                print(f"  {family}: round {r + 1}/{args.rounds}: none {times['none'][-1]:.1f} ms, "
                      f"bubblewrap {times['bubblewrap'][-1]:.1f} ms per rollout", flush=True)
            for kind, xs in times.items():
                rows[(family, kind)] = benchkit.median(xs)
    overhead = cmd_bwrap - cmd_none
    # The demo's 'tiny' rollouts run no command (no uid or tmpfs is set up): what they pay is the
    # snapshot the grader reads. A family with commands pays prepare/release + each command.
    demo_pct = snap_ms * DEMO_ROLLOUTS / 1e3 / DEMO_WALL_S * 100
    print(f"\n{'what':<44}{'none':>10}{'bubblewrap':>12}{'extra':>10}")
    print(f"{'ms per command (median, `true`)':<44}{cmd_none:>10.2f}{cmd_bwrap:>12.2f}{overhead:>10.2f}")
    print(f"{'  of which the cgroup (bubblewrap without it)':<44}{'':>10}{cmd_nocap:>12.2f}"
          f"{cmd_bwrap - cmd_nocap:>10.2f}")
    print(f"{'ms per rollout: sandbox prepare + release':<44}{'':>10}{prep_ms:>12.2f}{prep_ms:>10.2f}")
    print(f"{'ms per rollout: snapshot (1 file)':<44}{snap_ms:>10.2f}{snap_ms:>12.2f}{snap_ms:>10.2f}")
    for family in ("tiny", "repo_spec") if rows else ():
        a, b = rows[(family, "none")], rows[(family, "bubblewrap")]
        print(f"{'ms per rollout end to end, ' + family:<44}{a:>10.2f}{b:>12.2f}{b - a:>10.2f}")
    print("(end to end: 8 rollouts at once, median of interleaved rounds; a few ms of difference is noise.\n"
          " repo_spec with none runs its check runner with the venv's python, bubblewrap with the system one)")
    held = {True: "held", False: "killed"}
    print(f"memory cap {args.cap_mib} MiB ({cap['cgroup']}): 160 MiB in memfds {held[cap['memfd_160mib_held']]}, "
          f"in a user namespace's tmpfs {held[cap['userns_tmpfs_160mib_held']]}; peak {cap['peak_memory_bytes']} bytes")
    print(f"RL demo estimate: {DEMO_ROLLOUTS} tiny rollouts x {snap_ms:.2f} ms (snapshot) serialized = "
          f"{demo_pct:.3f}% of its {DEMO_WALL_S:.0f} s (upper bound); a rollout of a family with commands "
          f"adds {prep_ms:.1f} ms + {overhead:.1f} ms per command")
    return bench.emit({"overhead_per_command_ms": round(overhead, 3), "command_ms_none": round(cmd_none, 3),
                      "command_ms_bubblewrap": round(cmd_bwrap, 3),
                      "command_ms_bubblewrap_no_cgroup": round(cmd_nocap, 3), "prepare_release_ms": round(prep_ms, 3),
                      "snapshot_ms": round(snap_ms, 3),
                      **{f"rollout_ms_{f}_{k}": round(v, 2) for (f, k), v in rows.items()},
                      "demo_overhead_pct_upper_bound": round(demo_pct, 3), "sandbox_memory_cap_mib": args.cap_mib,
                      **cap, "commands": args.commands,
                      "rollouts": args.rollouts, "rounds": args.rounds},
                     sizes=dict(commands=args.commands, rollouts=args.rollouts, rounds=args.rounds, cap_mib=args.cap_mib,
                                fixed=args.fixed, warmup_rollouts=args.warmup_rollouts))


if __name__ == "__main__":
    main()
