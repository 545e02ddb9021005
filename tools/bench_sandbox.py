"""What the rollout sandbox costs: per tool command, per rollout, and on the RL demo.

    python tools/bench_sandbox.py [--commands 200] [--rollouts 32] [--rounds 4]

1. Per command: ``Workspace.run("true")`` (the harness's real `run` path: asyncio subprocess,
   output capture, stats) with no sandbox against a bubblewrap sandbox, interleaved so load
   drift hits both; medians. ``overhead_per_command_ms`` is the difference.
2. Per rollout (interleaved rounds, median): full harness rollouts (aiohttp -> FakeOpenAIServer on 127.0.0.1 -> scripted
   replies, workspace, snapshot, grader subprocess) with sandbox kind none vs bubblewrap, for
   the demo's family ('tiny': write_file + finish, no command: no uid or tmpfs is set up) and
   for 'repo_spec' (one `run` command, its grader running agent code in a sandbox too).
3. The RL demo (configs/demo.py: 60 steps x 64 'tiny' rollouts, 367 s measured on a quiet
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

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
import time
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

DEMO_WALL_S = 367.0  # configs/demo.py, elastic, measured Dec 1 2026 (quiet machine)
DEMO_ROLLOUTS = 60 * 64


async def _command_ms(n: int, root: Path) -> tuple[float, float]:
    plain = Workspace(root / "plain", sandbox=None)
    (root / "plain").mkdir()
    box = sb.make_sandbox(sb.SandboxConfig(kind="bubblewrap"), root / "boxed", family="bench", name="bench")
    (root / "boxed").mkdir()
    box.prepare()
    boxed = Workspace(root / "boxed", sandbox=box)
    try:
        t_plain, t_box = [], []
        for k in range(n + 5):
            for ws, acc in ((plain, t_plain), (boxed, t_box)):
                t0 = time.perf_counter()
                out = await ws.run("true")
                dt = time.perf_counter() - t0
                assert out.startswith("exit code 0"), out
                if k >= 5:  # warm-up: page cache, first exec
                    acc.append(dt * 1e3)
            if k and k % 50 == 0:
                print(f"  commands: {k}/{n}", flush=True)
    finally:
        box.release()
    return statistics.median(t_plain), statistics.median(t_box)


def _fixed_ms(n: int, root: Path) -> tuple[float, float]:
    """(prepare + release of a rollout's sandbox: uid, tmpfs mount/umount as root; snapshot of a
    one-file workspace as the grader gets it), medians in ms."""
    prep, snap = [], []
    for k in range(n):
        ws = root / f"fixed-{k}"
        ws.mkdir()
        t0 = time.perf_counter()
        box = sb.make_sandbox(sb.SandboxConfig(kind="bubblewrap"), ws, family="bench", name="b")
        box.prepare()
        Workspace(ws, sandbox=box).write_file("answer.txt", "cba")
        t1 = time.perf_counter()
        snapshot_workspace(ws, root / f"snap-{k}", max_bytes=1 << 20)
        t2 = time.perf_counter()
        box.release()
        prep.append((time.perf_counter() - t2 + t1 - t0) * 1e3)
        snap.append((t2 - t1) * 1e3)
    return statistics.median(prep), statistics.median(snap)


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
        t0 = time.perf_counter()
        results = await run_rollouts(reqs, cfg, workspace_root=root / f"{tag}-{kind}-{task.family}")
        dt = time.perf_counter() - t0
    bad = [r for r in results if r.score != 1.0]
    if bad:
        raise SystemExit(f"bench: {len(bad)} {kind} rollouts did not score 1: {bad[0].status} {bad[0].error} "
                         f"{bad[0].grader_details}")
    return dt / n * 1e3


def _reply(msg: dict) -> dict:
    return {"content": msg.get("content") or "", "tool_calls": msg.get("tool_calls")}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--commands", type=int, default=200, help="commands per mode")
    ap.add_argument("--rollouts", type=int, default=32, help="rollouts per mode, family and round")
    ap.add_argument("--rounds", type=int, default=4, help="interleaved rounds (median)")
    args = ap.parse_args()
    ok, why = sb.bwrap_usable()
    if not ok:
        raise SystemExit(f"bench_sandbox: {why}")
    with tempfile.TemporaryDirectory(prefix="gyre_bench_sbx_") as tmp:
        root = Path(tmp)
        print(f"per command: {args.commands} x `true` through Workspace.run, interleaved", flush=True)
        cmd_none, cmd_bwrap = asyncio.run(_command_ms(args.commands, root))
        prep_ms, snap_ms = _fixed_ms(200, root)
        rows = {}
        for family, task in (("tiny", tiny.make_task(1)), ("repo_spec", repo_spec.make_task(1, n_modules=1))):
            asyncio.run(_rollouts_ms("none", task, 8, root / "warmup", f"warm-{family}"))  # imports, first grader
            times = {"none": [], "bubblewrap": []}
            for r in range(args.rounds):  # interleaved rounds: load drift hits both kinds
                for kind in ("none", "bubblewrap") if r % 2 == 0 else ("bubblewrap", "none"):
                    times[kind].append(asyncio.run(_rollouts_ms(kind, task, args.rollouts, root, f"r{r}")))
                print(f"  {family}: round {r + 1}/{args.rounds}: none {times['none'][-1]:.1f} ms, "
                      f"bubblewrap {times['bubblewrap'][-1]:.1f} ms per rollout", flush=True)
            for kind, xs in times.items():
                rows[(family, kind)] = statistics.median(xs)
    overhead = cmd_bwrap - cmd_none
    # The demo's 'tiny' rollouts run no command (no uid or tmpfs is set up): what they pay is the
    # snapshot the grader reads. A family with commands pays prepare/release + each command.
    demo_pct = snap_ms * DEMO_ROLLOUTS / 1e3 / DEMO_WALL_S * 100
    print(f"\n{'what':<44}{'none':>10}{'bubblewrap':>12}{'extra':>10}")
    print(f"{'ms per command (median, `true`)':<44}{cmd_none:>10.2f}{cmd_bwrap:>12.2f}{overhead:>10.2f}")
    print(f"{'ms per rollout: sandbox prepare + release':<44}{'':>10}{prep_ms:>12.2f}{prep_ms:>10.2f}")
    print(f"{'ms per rollout: snapshot (1 file)':<44}{snap_ms:>10.2f}{snap_ms:>12.2f}{snap_ms:>10.2f}")
    for family in ("tiny", "repo_spec"):
        a, b = rows[(family, "none")], rows[(family, "bubblewrap")]
        print(f"{'ms per rollout end to end, ' + family:<44}{a:>10.2f}{b:>12.2f}{b - a:>10.2f}")
    print("(end to end: 8 rollouts at once, median of interleaved rounds; a few ms of difference is noise.\n"
          " repo_spec with none runs its check runner with the venv's python, bubblewrap with the system one)")
    print(f"RL demo estimate: {DEMO_ROLLOUTS} tiny rollouts x {snap_ms:.2f} ms (snapshot) serialized = "
          f"{demo_pct:.3f}% of its {DEMO_WALL_S:.0f} s (upper bound); a rollout of a family with commands "
          f"adds {prep_ms:.1f} ms + {overhead:.1f} ms per command")
    print(json.dumps({"overhead_per_command_ms": round(overhead, 3), "command_ms_none": round(cmd_none, 3),
                      "command_ms_bubblewrap": round(cmd_bwrap, 3), "prepare_release_ms": round(prep_ms, 3),
                      "snapshot_ms": round(snap_ms, 3),
                      **{f"rollout_ms_{f}_{k}": round(v, 2) for (f, k), v in rows.items()},
                      "demo_overhead_pct_upper_bound": round(demo_pct, 3), "commands": args.commands,
                      "rollouts": args.rollouts, "rounds": args.rounds}))


if __name__ == "__main__":
    main()
