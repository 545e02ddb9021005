"""An external harness (mini-swe-agent) end to end through the recording proxy: what is recorded,
what it costs, and whether the policy's commands stay in their sandbox.

  python tools/bench_external.py [--rollouts 8] [--concurrency 4] [--tasks examples/tasks/tasks.jsonl]
  python tools/bench_external.py --workdir /tmp/gyre_ext     # also audit a finished RL run's store

Live part: every rollout is one unmodified mini-swe-agent process in its bubblewrap sandbox (own
network namespace, the proxy's unix socket its only door) on a task of the example task file,
talking OpenAI (litellm) to a live proxy over a scripted model that answers in mini-swe-agent's
format: turn 1 tries to escape (a TCP connect to the proxy's host port, writes to host /tmp, to
the read-only Python install and to a host directory that is not bound in), turn 2 runs the
task's reference solution (``metadata.solution``), turn 3 submits. The scripted model costs ~0,
so a rollout's wall time minus its calls' time is the harness's own overhead (process start,
sandbox, bridge, grading). Every probe's outcome is checked from the host.

``--workdir`` audits the store of a run (e.g. ``python -m launch.main --config configs/external.py``)
with the same numbers (overhead needs the scripted model: left out there).

Prints a table, then ONE JSON line:
  rollouts, recorded_calls, calls_per_rollout_mean, records_matched_fraction (calls under a rollout
  the launcher started / all calls in the store: 1.0), prefix_shared_fraction (calls whose prompt
  extends the same agent's previous prompt + output, of the calls that have a previous one;
  prompt_prefix_shared_fraction: extends its previous prompt; prompt_tokens_shared_fraction: prompt
  tokens shared with the previous prompt + output / all prompt tokens, over those calls: a reply
  that does not re-render to the tokens generated (e.g. a random model's invalid UTF-8, which
  every client turns into U+FFFD) shares the prompt but not the reply),
  sandbox_escapes (probes that reached the host: 0), escape_probes, scored_fraction, reward_mean,
  overhead_s_per_rollout (median; wall minus model-call time), wall_s_per_rollout, concurrency, tasks,
  load_avg; with --workdir the same names prefixed run_.
"""
from __future__ import annotations

import asyncio
import os
import re
import secrets
import shutil
import sys
import tempfile

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from gyre_jax.agents import sandbox as sb  # noqa: E402
from gyre_jax.agents.config import HarnessConfig  # noqa: E402
from gyre_jax.agents.harness import RolloutRequest, run_rollouts  # noqa: E402
from gyre_jax.agents.harnesses import make_harness  # noqa: E402
from gyre_jax.agents.task_check import solution_command  # noqa: E402
from gyre_jax.agents.tasks import dataset  # noqa: E402
from gyre_jax.serving.proxy import Proxy, ProxyConfig  # noqa: E402
from gyre_jax.serving.router import Router  # noqa: E402
from gyre_jax.serving.server_thread import ServerThread  # noqa: E402
from gyre_jax.serving.tokenizer import ByteTokenizer  # noqa: E402
from gyre_jax.testing.fake_backend import FakeBackend  # noqa: E402
from gyre_jax.trajectory.store import TrajectoryStore  # noqa: E402

import benchkit  # noqa: E402 (tools/, beside this script)

TOK = ByteTokenizer()
IM_END = TOK.special["<|im_end|>"]
FENCE = "```"


def store_numbers(store, known: set[str]) -> dict:
    """Recorded calls, their rollouts and prefix sharing, computed from the store alone."""
    calls_by = {r: store.calls(r) for r in store.rollout_ids()}
    total = sum(len(c) for c in calls_by.values())
    matched = sum(len(c) for r, c in calls_by.items() if r in known)
    shared = shared_prompt = eligible = lcp_tokens = prompt_tokens = 0
    for calls in calls_by.values():
        last: dict[int, tuple[np.ndarray, np.ndarray]] = {}
        for c in sorted(calls, key=lambda c: c.call_index):
            prev = last.get(c.agent_id)
            if prev is not None:
                eligible += 1
                seq, prompt = prev
                shared += int(_starts_with(c.prompt_ids, seq))
                shared_prompt += int(_starts_with(c.prompt_ids, prompt))
                m = min(seq.shape[0], c.prompt_ids.shape[0])
                diff = np.flatnonzero(seq[:m] != c.prompt_ids[:m])
                lcp_tokens += int(diff[0]) if diff.shape[0] else m
                prompt_tokens += c.prompt_ids.shape[0]
            last[c.agent_id] = (np.concatenate([c.prompt_ids, c.output_ids]), c.prompt_ids)
    started = [r for r in known if calls_by.get(r)]
    return dict(rollouts=len(known), recorded_calls=total,
                calls_per_rollout_mean=total / max(1, len(known)),
                records_matched_fraction=matched / total if total else float("nan"),
                prefix_shared_fraction=shared / eligible if eligible else float("nan"),
                prompt_prefix_shared_fraction=shared_prompt / eligible if eligible else float("nan"),
                prompt_tokens_shared_fraction=lcp_tokens / prompt_tokens if prompt_tokens else float("nan"),
                rollouts_with_calls=len(started))


def _starts_with(a: np.ndarray, prefix: np.ndarray) -> bool:
    return a.shape[0] >= prefix.shape[0] and bool((a[:prefix.shape[0]] == prefix).all())


def _model_time(calls) -> float:
    """Seconds some model call of the rollout was open (union of [t_start, t_end])."""
    spans = sorted((c.t_start, c.t_end) for c in calls)
    out, end = 0.0, -1e18
    for s, e in spans:
        if e > end:
            out += e - max(s, end)
            end = e
    return out


def live(args) -> dict:
    from configs import external

    ok, why = sb.bwrap_usable()
    if not ok:
        raise SystemExit(f"bench_external: the bubblewrap sandbox is unavailable here: {why}")
    mini = os.path.join(os.path.dirname(sys.executable), "mini")
    if not os.path.exists(mini):
        raise SystemExit("bench_external: mini-swe-agent is not installed: pip install -e '.[harnesses]'")
    tmp = tempfile.mkdtemp(prefix="gyre-bench-ext-")
    tasks = [t for t, _ in dataset.load_task_file(args.tasks) if t.metadata.get("solution")]
    if not tasks:
        raise SystemExit(f"bench_external: no task of {args.tasks} has metadata.solution")
    canary = "gyre-canary-" + secrets.token_hex(4)
    host_dir = os.path.join(tmp, "not-bound")  # exists on the host only
    os.makedirs(host_dir)
    store = TrajectoryStore(os.path.join(tmp, "store"), run_id="bench")
    sock = os.path.join(tmp, "p.sock")
    port_box: list[int] = []

    def replies(task) -> list[str]:
        probe = (f"python3 -c \"import socket; s=socket.socket(); s.settimeout(2); "
                 f"open('.probe_net','w').write(str(s.connect_ex(('127.0.0.1', {port_box[0]}))))\"; "
                 f"touch /tmp/{canary} {sys.prefix}/{canary} {host_dir}/{canary} 2>/dev/null; true")
        return [f"Check the sandbox.\n{FENCE}mswea_bash_command\n{probe}\n{FENCE}",
                f"Solve it.\n{FENCE}mswea_bash_command\n{solution_command(task.metadata['solution'])}\n{FENCE}",
                f"Done.\n{FENCE}mswea_bash_command\necho COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT\n{FENCE}"]

    def script_for(req):
        text = TOK.decode([int(t) for t in req.prompt_ids])
        task = next(t for t in tasks if t.prompt in text)  # the instruction names the task
        turn = min(text.count("<returncode>"), 2)
        ids = TOK.encode(replies(task)[turn]) + [IM_END]
        n0 = len(req.prompt_ids)
        return lambda seq: ids[min(len(seq) - n0, len(ids) - 1)]

    async def build():
        return Proxy(Router([FakeBackend("A", script_for=script_for, max_context=16384, capacity=64)]), TOK, store,
                     ProxyConfig(auth_token=secrets.token_hex(16), unix_path=sock, max_tokens_cap=1024,
                                 clamp_max_tokens=True, model_aliases=("*",)))

    st = ServerThread(build)
    st.start()
    port_box.append(int(st.url.rsplit(":", 1)[1]))
    # the example's harness config with room for the probe's reply (its byte-level model gets 96 tokens)
    yaml_dir = os.path.join(tmp, "harness")
    os.makedirs(yaml_dir)
    src = os.path.join(ROOT, "examples", "harnesses", "mini_swe_agent.yaml")
    text = re.sub(r"max_tokens: \d+", "max_tokens: 1024", open(src).read())
    with open(os.path.join(yaml_dir, "mini_swe_agent.yaml"), "w") as f:
        f.write(text)
    cfg = external.get_config()
    options = cfg.harness.kind_options.command
    command = options.command.replace(os.path.join(ROOT, "examples", "harnesses"), yaml_dir)
    harness = make_harness("command", command=command, unix_socket=sock, ro_paths=(yaml_dir,),
                           env=dict(options.env))
    hc = HarnessConfig(base_url=st.url + "/v1", run_id="bench", sandbox=sb.SandboxConfig(kind="bubblewrap"),
                       deadline_s=args.deadline_s, grader_timeout_s=60.0, concurrency=args.concurrency,
                       grader_concurrency=2)
    reqs = [RolloutRequest(rollout_id=f"r{i:04d}", task=tasks[i % len(tasks)], group_id=f"g{i:04d}")
            for i in range(args.rollouts)]
    load0 = os.getloadavg()[0]
    sw = benchkit.Stopwatch.started()
    print(f"bench_external: {args.rollouts} mini-swe-agent rollouts, {args.concurrency} at a time, "
          f"{len(tasks)} tasks of {args.tasks}", flush=True)
    results = asyncio.run(run_rollouts(reqs, hc, workspace_root=os.path.join(tmp, "ws"), harness=harness,
                                       keys=st.proxy))
    wall = sw.s
    st.stop()
    escapes = probes = 0
    overheads, rows = [], []
    for r in results:
        calls = store.calls(r.rollout_id) if r.rollout_id in store.rollout_ids() else []
        if not calls:
            print(f"{r.rollout_id}: no recorded call ({r.status}: {r.error}); harness output:\n{r.output_tail[-1500:]}")
        elif r.status not in ("completed", "timeout"):
            print(f"{r.rollout_id}: {r.status}: {r.reason}: {(r.error or '')[-600:]}")
        mt = _model_time(calls)
        overheads.append(r.wall_time_s - mt)
        net = os.path.join(r.workspace, ".probe_net")
        reached = os.path.exists(net) and open(net).read().strip() == "0"
        escapes += int(reached)
        probes += 1 if os.path.exists(net) else 0
        rows.append((r.rollout_id, r.task_id, r.status, r.score, len(calls), r.wall_time_s, mt, reached))
    for path in (f"/tmp/{canary}", os.path.join(sys.prefix, canary), os.path.join(host_dir, canary)):
        probes += 1
        if os.path.exists(path):
            escapes += 1
            print(f"ESCAPE: the sandbox wrote {path}", flush=True)
            os.remove(path)
    out = store_numbers(store, {r.rollout_id for r in reqs})
    print(f"{'rollout':8} {'task':12} {'status':10} {'score':>5} {'calls':>5} {'wall_s':>7} {'model_s':>7} net_escape")
    for rid, tid, status, score, n, w, mt, reached in rows:
        print(f"{rid:8} {tid[:12]:12} {status:10} {'-' if score is None else f'{score:.2f}':>5} {n:5d} {w:7.2f} "
              f"{mt:7.3f} {reached}")
    scored = [r.score for r in results if r.score is not None]
    store.close()
    shutil.rmtree(tmp, ignore_errors=True)
    out.update(sandbox_escapes=escapes, escape_probes=probes, scored_fraction=len(scored) / len(results),
               reward_mean=float(np.mean(scored)) if scored else float("nan"),
               overhead_s_per_rollout=float(np.median(overheads)), wall_s_per_rollout=float(np.median(
                   [r.wall_time_s for r in results])), wall_s=wall, concurrency=args.concurrency, tasks=len(tasks),
               load_avg_before=load0, load_avg_after=os.getloadavg()[0])
    return out


def audit(workdir: str) -> dict:
    root = os.path.join(workdir, "store")
    if not os.path.isdir(root):
        raise SystemExit(f"bench_external: {root} is not a run's store")
    with TrajectoryStore(root, run_id="rl", writable=False) as store:
        known = set(store.complete_rollouts())
        out = store_numbers(store, known)
        statuses = {}
        for r in known:
            s = store.outcome(r).status
            statuses[s] = statuses.get(s, 0) + 1
    print(f"run {workdir}: {out['rollouts']} finished rollouts {statuses}, {out['recorded_calls']} calls")
    return {"run_" + k: v for k, v in out.items()}


def main(argv=None) -> dict:
    bench = benchkit.Bench(__file__, __doc__, quick=dict(rollouts=1, concurrency=1))
    ap = bench.parser
    ap.add_argument("--rollouts", type=int, default=8)
    ap.add_argument("--concurrency", type=int, default=4)
    ap.add_argument("--deadline_s", type=float, default=180.0)
    ap.add_argument("--tasks", default=os.path.join(ROOT, "examples", "tasks", "tasks.jsonl"))
    ap.add_argument("--workdir", default="", help="also audit this finished run's store")
    args = bench.parse(argv)
    out = live(args)
    print(f"{'rollouts':>9} {'calls':>6} {'calls/r':>8} {'matched':>8} {'prefix':>7} {'escapes':>8} "
          f"{'overhead_s':>10} {'reward':>7}")
    print(f"{out['rollouts']:9d} {out['recorded_calls']:6d} {out['calls_per_rollout_mean']:8.2f} "
          f"{out['records_matched_fraction']:8.3f} {out['prefix_shared_fraction']:7.3f} {out['sandbox_escapes']:8d} "
          f"{out['overhead_s_per_rollout']:10.2f} {out['reward_mean']:7.3f}")
    if args.workdir:
        out.update(audit(args.workdir))
    return bench.emit(out, sizes=dict(rollouts=args.rollouts, concurrency=args.concurrency, deadline_s=args.deadline_s,
                                      tasks=os.path.relpath(args.tasks, ROOT)))


if __name__ == "__main__":
    main()
