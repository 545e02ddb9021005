"""Chaos bench: random kill -9s and SIGTERMs of the demo run, reruns to the end, then an audit.

  python tools/bench_chaos.py [--trials 2] [--kills 3] [--steps 8] [--sft-steps 20] [--seed 0]
  python tools/bench_chaos.py --quick          # one trial, 2 stops, 4 steps: a smoke check (~3-5 min on 2 cores)
  python tools/bench_chaos.py --disk-full 1    # + a trial whose workdir is a small tmpfs that fills (needs root)
  python tools/bench_chaos.py --trials 0 --write-faults cursor,checkpoint   # only injected write faults there
  python tools/bench_chaos.py --fake-engines --sigterm 0    # kill -9s only, engines faked: replay, in minutes

Each trial is a fresh workdir running the README demo (``python -m launch.main --config
configs/demo.py --workdir W --config.steps=N --config.sft.steps=M --config.checkpoint_every=K``,
eval off). ``--kills`` times, an attempt is started and stopped at a random moment: one in four at a
random time after its start (uniform in [2, 90] s: imports, SFT, the resume itself, the first
steps), the others at a random point of its progress (once the progress line reaches a random step still
to run, before the last, then uniform [0, 8) s more). The stop is SIGTERM with probability ``--sigterm``, else
SIGKILL. A SIGTERM must end the process with exit 143 (or 0 if it had just finished) within
``--term-grace-s``; otherwise it counts as a hang and the process is killed. Then the same
command runs again (at most ``--reruns`` times) until it exits 0; an attempt that outlives
``--attempt-timeout-s`` is a hang. A workdir that never completes is unresumable.

A disk-full trial (``--disk-full``; needs ``mount``, i.e. root) runs in a workdir that is a
tmpfs of a random size in [1.5, 4] MB (a whole 8-step demo fit in a 5.7 MB one): the first attempt must
stop by itself with exit 3 (our storage failed, ``error:`` naming the path) and no hang; the
tmpfs is then remounted at 1 GB and the same command reruns to the end (it may be stopped by
``--kills`` random stops before that, like any trial). Every attempt that ended with exit 3 is
one ``write_faults``.

A write-fault trial (``--write-faults``, default every site of ``gyre_jax.testing.faulty_main.SITES``: the
store's frame for a proxy call record, for a grader outcome, the log's fsync, the cursor journal, Orbax's
checkpoint save, a weight publication) starts its first attempt as ``python -m gyre_jax.testing.faulty_main
--fault=SITE:N <the same flags>``: from the N-th write at SITE on (N drawn per site so it lands inside the
RL steps) every write there fails. That attempt must end by itself with one ``error:`` line and exit 3
(our storage failed; 1 for the publisher, whose failure takes serving cells out until none is left) within
``--fault-exit-s`` of the injection; then ``launch.main`` reruns the same workdir to the end, with no
random stops. Each such attempt is one ``write_faults``; per site the JSON says the exit code, the
seconds from injection to exit, whether the error line was the one line, and the rerun's audit.

The audit (``gyre_jax.rl.audit``) reads only the workdir: the store's outcomes and cursor,
and metrics.jsonl. Prints a table (one row per attempt, then one per trial's audit), then ONE
JSON line: trials, kills (stops delivered to a live run: kill9 + sigterm), kill9, sigterm,
resumes (attempts that said "resumed from checkpoint"), restarts (attempts after a trial's
first), rollouts_lost, rollouts_trained_twice, groups_short, wrong_state,
max_staleness_over_bound (max over trials), staleness_bound, duplicate_steps, replayed_steps (steps a
resume trained again from their records: a kill -9 rewinds to the last checkpoint and replays what the
cursor recorded after it), params_hash_equal and params_hash_differ (each step line a rewind purged, against
the surviving lineage's line of that step: a replayed version must be the lost run's, bit for bit),
oversized_steps and extra_groups (steps that took more than groups_per_step groups after a rewind past the
bound, and how many more: only what could not be replayed), infra_errors
(infra_error outcomes that are not abandoned attempts), write_faults (attempts stopped by a full
disk or an injected write fault with the expected code), write_fault_sites, write_fault_results (per
site: n, rc, expected_rc, exit_s, one_error_line, completed, lost, twice, short), hangs, leftover_processes (processes of a stopped attempt
still alive 2 s after it: harness or sandbox children a kill -9 orphaned; killed by the bench), unresumable_workdirs, finished_rollouts,
wall_s, and the sizes (steps, sft_steps, checkpoint_every, groups_per_step, group_size, seed).
"""
from __future__ import annotations

import os
import random
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from configs import demo as demo_config  # noqa: E402
from gyre_jax.rl.audit import audit_workdir  # noqa: E402
from gyre_jax.testing.faulty_main import INJECTED, SITES  # noqa: E402

import benchkit  # noqa: E402 (tools/, beside this script)

STEP_RE = re.compile(r"^rl\[[\w-]+\]: step (\d+)/(\d+)", re.M)  # the RL progress line, not SFT's


def _cmd(workdir: str, a, fault: str | None = None) -> list[str]:
    entry = (["gyre_jax.testing.faulty_main", *([f"--fault={fault}"] if fault else []),
              *(["--fake-engines"] if a.fake_engines else [])] if fault or a.fake_engines else ["launch.main"])
    return [sys.executable, "-m", *entry, "--config", "configs/demo.py", "--workdir", workdir,
            f"--config.steps={a.steps}", f"--config.sft.steps={a.sft_steps}",
            f"--config.checkpoint_every={a.checkpoint_every}", "--config.eval.every=0", *a.extra]


def _read(path: str) -> str:
    try:
        with open(path, errors="replace") as f:
            return f.read()
    except FileNotFoundError:
        return ""


def _steps_seen(text: str) -> int:
    return max((int(m.group(1)) for m in STEP_RE.finditer(text)), default=0)


class Attempt:
    def __init__(self, workdir: str, log_path: str, a, fault: str | None = None):
        self.log_path = log_path
        self.t0 = time.monotonic()
        with open(log_path, "w") as log:
            # Own session: a stop reaches the launcher only, as a kill of one process does, and a hung
            # attempt's children can be cleaned up by group.
            self.p = subprocess.Popen(_cmd(workdir, a, fault), cwd=ROOT, stdout=log, stderr=subprocess.STDOUT,
                                      stdin=subprocess.DEVNULL, start_new_session=True)

    def elapsed(self) -> float:
        return time.monotonic() - self.t0

    def text(self) -> str:
        return _read(self.log_path)

    def wait(self, timeout: float) -> int | None:
        try:
            return self.p.wait(timeout=max(0.0, timeout))
        except subprocess.TimeoutExpired:
            return None

    def kill_group(self) -> None:
        try:
            os.killpg(self.p.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.p.wait()


def _leftovers(workdir: str) -> list[int]:
    """Live processes (ours: this machine's, started by an attempt) whose cwd or command line is under ``workdir``."""
    out = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            cwd = os.readlink(f"/proc/{pid}/cwd")
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                cmd = f.read().decode(errors="replace")
        except OSError:
            continue
        if cwd.startswith(workdir) or workdir in cmd:
            out.append(int(pid))
    return out


def _last_error(text: str) -> str:
    lines = [x for x in text.splitlines() if x.startswith(("error:", "stopped:", "Traceback"))]
    return lines[-1][:160] if lines else ""


def _fault_n(site: str, a, rng: random.Random) -> int:
    """The N of ``--fault=SITE:N``: a write that comes inside the RL steps of a fresh demo attempt."""
    per_step = demo_config.get_config().scheduler.groups_per_step * demo_config.get_config().scheduler.group_size
    last = max(1, a.steps - 1)
    if site in ("call", "outcome"):  # one call per rollout of the 'tiny' tasks; the first steps' rollouts
        return rng.randint(1, per_step * last)
    if site == "log_sync":  # one fsync a second at most while frames are appended
        return rng.randint(1, 10)
    if site == "cursor":  # one or two journal lines per step (trained, dropped)
        return rng.randint(1, last)
    if site == "checkpoint":  # checkpoint 0 at the start (write 1), then every checkpoint_every-th step and the last
        return rng.randint(2, 1 + max(1, a.steps // a.checkpoint_every))
    return rng.randint(4, 3 + last)  # publisher: after the start's loads into the serving cells, one per step


def _fault_attempt(att: "Attempt", a) -> tuple[object, float | None]:
    """Wait for a faulty attempt's own end; (rc or None for a hang, seconds from the injection to the exit)."""
    injected_at = None
    while True:
        rc = att.wait(0.5)
        if injected_at is None and INJECTED in att.text():
            injected_at = att.elapsed()
        if rc is not None:
            return rc, None if injected_at is None else round(att.elapsed() - injected_at, 1)
        if att.elapsed() > a.attempt_timeout_s or (injected_at is not None
                                                   and att.elapsed() - injected_at > a.fault_exit_s):
            att.kill_group()
            return None, round(att.elapsed() - injected_at, 1) if injected_at is not None else None


def run_trial(trial: int, a, rng: random.Random, rows: list, *, disk_mb: float | None = None,
              fault: str | None = None) -> dict:
    workdir = os.path.join(a.root, f"trial{trial}")
    shutil.rmtree(workdir, ignore_errors=True)
    os.makedirs(workdir)
    if disk_mb is not None:  # a real full disk: the kernel answers ENOSPC wherever the run writes next
        subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={int(disk_mb * 1024)}k", "tmpfs", workdir], check=True)
    t = dict(kill9=0, sigterm=0, hangs=0, leftover_processes=0, write_faults=0, disk_mb=disk_mb, fault=fault,
             resumes=0, restarts=0, attempts=0, completed=False, failed_rc=[])

    def start(fault: str | None = None) -> Attempt:
        t["attempts"] += 1
        if t["attempts"] > 1:
            t["restarts"] += 1
        return Attempt(workdir, os.path.join(a.root, f"trial{trial}.{t['attempts']}.log"), a, fault)

    def finish(att: Attempt, rc, what: str, stop_s=None) -> None:
        text = att.text()
        if rc != 0:
            time.sleep(2.0)  # children a stop left get a moment to go on their own
        left = _leftovers(workdir)
        t["leftover_processes"] += len(left)
        for pid in left:  # processes of the attempt just stopped (cwd under its workdir): not the next one's
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        t["resumes"] += "resumed from checkpoint" in text
        rows.append(dict(trial=trial, attempt=t["attempts"], stop=what, at_s=round(att.elapsed(), 1), rc=rc,
                         stop_s=stop_s, steps_seen=_steps_seen(text), last=_last_error(text)))

    if disk_mb is not None:
        att = start()
        rc = att.wait(a.attempt_timeout_s)
        if rc is None:
            t["hangs"] += 1
            att.kill_group()
        t["write_faults"] += rc == 3
        if rc not in (0, 3, None):
            t["failed_rc"].append(rc)
        finish(att, "hang" if rc is None else rc, f"disk full ({disk_mb:.1f} MB tmpfs)")
        t["completed"] = rc == 0
        subprocess.run(["mount", "-o", "remount,size=1g", workdir], check=True)  # room again
    if fault is not None:
        site = fault.split(":")[0]
        expected = 1 if site == "publisher" else 3
        att = start(fault)
        rc, exit_s = _fault_attempt(att, a)
        text = att.text()
        errors = [x for x in text.splitlines() if x.startswith("error:")]
        t["hangs"] += rc is None
        t["write_faults"] += rc == expected
        if rc not in (0, expected, None):
            t["failed_rc"].append(rc)
        t["fault_result"] = dict(site=site, n=int(fault.split(":")[1]), rc=rc, expected_rc=expected, exit_s=exit_s,
                                 injected=INJECTED in text, one_error_line=len(errors) == 1
                                 and text.rstrip().splitlines()[-1] == errors[-1])
        finish(att, "hang" if rc is None else rc, f"write fault {fault}", exit_s)
        t["completed"] = rc == 0  # the fault came too late to fire: a finished run
    for _ in range(0 if t["completed"] or fault is not None else a.kills):
        att = start()
        done = _steps_seen(_read_prev_logs(a.root, trial))
        if rng.random() < 0.25 or done >= a.steps - 1:  # mostly inside the RL steps, where the state changes
            trigger, when = "time", rng.uniform(2.0, 90.0)
        else:  # before the last step: a stop after it would often find the run finished
            trigger, when = "step", (rng.randint(done + 1, a.steps - 1), rng.uniform(0.0, 8.0))
        sig = signal.SIGTERM if rng.random() < a.sigterm else signal.SIGKILL
        reached_at = None
        while True:
            rc = att.wait(0.5)
            if rc is not None:
                break
            if att.elapsed() > a.attempt_timeout_s:
                break
            if trigger == "time" and att.elapsed() >= when:
                break
            if trigger == "step":
                if reached_at is None and _steps_seen(att.text()) >= when[0]:
                    reached_at = att.elapsed()
                if reached_at is not None and att.elapsed() >= reached_at + when[1]:
                    break
        desc = f"{sig.name} at {'%.1fs' % when if trigger == 'time' else 'step %d+%.1fs' % when}"
        if rc is not None:  # it ended before the stop: finished (0) or failed on its own
            finish(att, rc, f"none ({desc} planned)")
            if rc == 0:
                t["completed"] = True
                break
            t["failed_rc"].append(rc)
            continue
        if att.elapsed() > a.attempt_timeout_s:
            t["hangs"] += 1
            att.kill_group()
            finish(att, "hang", f"hang (> {a.attempt_timeout_s:.0f}s)")
            continue
        t0 = time.monotonic()
        att.p.send_signal(sig)
        if sig == signal.SIGKILL:
            rc = att.wait(60)
            t["kill9"] += 1
            finish(att, rc, desc)
            att.kill_group()  # what the launcher started in its own session dies with it; nothing else is left
            continue
        rc = att.wait(a.term_grace_s)
        stop_s = round(time.monotonic() - t0, 1)
        if rc is None:
            t["hangs"] += 1
            att.kill_group()
            finish(att, "hang", desc + f" (no exit in {a.term_grace_s:.0f}s)", stop_s)
        else:
            t["sigterm"] += 1
            # Never -15 (the default action, no line): launch.main answers a stop from its first line on
            # (launch/early_stop.py), so a signal death means its handler came too late again.
            if rc not in (0, 143):
                t["failed_rc"].append(rc)
            finish(att, rc, desc, stop_s)
            if rc == 0:
                t["completed"] = True
                break
    reruns = 0
    while not t["completed"] and reruns < a.reruns:
        reruns += 1
        att = start()
        rc = att.wait(a.attempt_timeout_s)
        if rc is None:
            t["hangs"] += 1
            att.kill_group()
            finish(att, "hang", f"rerun: hang (> {a.attempt_timeout_s:.0f}s)")
            continue
        finish(att, rc, "rerun to the end")
        if rc == 0:
            t["completed"] = True
        else:
            t["failed_rc"].append(rc)
    t["workdir"] = workdir
    return t


def _read_prev_logs(root: str, trial: int) -> str:
    return "".join(_read(os.path.join(root, n)) for n in sorted(os.listdir(root)) if n.startswith(f"trial{trial}."))


def main(argv=None) -> dict:
    bench = benchkit.Bench(__file__, __doc__, quick=dict(trials=1, kills=2, steps=4, sft_steps=10, checkpoint_every=2),
                           quick_help="1 trial, 2 stops, 4 steps, 10 SFT steps, no write faults")
    ap = bench.parser
    ap.add_argument("--trials", type=int, default=2)
    ap.add_argument("--kills", type=int, default=3, help="stops per trial before the rerun to the end")
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--sft-steps", type=int, default=20)
    ap.add_argument("--checkpoint-every", type=int, default=3)
    ap.add_argument("--sigterm", type=float, default=0.3, help="probability that a stop is SIGTERM, not kill -9")
    ap.add_argument("--term-grace-s", type=float, default=60.0)
    ap.add_argument("--attempt-timeout-s", type=float, default=900.0)
    ap.add_argument("--reruns", type=int, default=3)
    ap.add_argument("--disk-full", type=int, default=0, help="more trials whose workdir is a small tmpfs that fills")
    ap.add_argument("--write-faults", default=None,
                    help=f"comma-separated sites of injected write faults, a trial each ({','.join(SITES)}), "
                         "'all' (the default) or 'none' (the default with --quick)")
    ap.add_argument("--fault-exit-s", type=float, default=120.0,
                    help="an injected fault's attempt must exit this soon after the injection, else it is a hang")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--fake-engines", action="store_true",
                    help="engines of gyre_jax.testing.fake_engine (no JAX decode; everything else real): minutes, not hours")
    ap.add_argument("--root", default=None, help="where the trials' workdirs go (default: a new temp dir)")
    ap.add_argument("--keep", action="store_true", help="keep the workdirs")
    ap.add_argument("extra", nargs="*", help="more --config.X=V flags for every attempt (after --)")
    a = bench.parse(argv)
    if a.write_faults is None:
        a.write_faults = "none" if a.quick else "all"
    sites = (list(SITES) if a.write_faults == "all" else [] if a.write_faults == "none"
             else [x for x in a.write_faults.split(",") if x])
    for x in sites:
        if x not in SITES:
            ap.error(f"--write-faults: unknown site {x!r}; known: {', '.join(SITES)}")
    for x in a.extra:
        if not x.startswith("--config."):
            ap.error(f"extra argument {x!r}: only --config.X=V flags pass through")
    cfg = demo_config.get_config()
    for x in a.extra:  # the audit needs the group size and staleness bound the run used
        k, _, v = x[len("--config."):].partition("=")
        if k in ("scheduler.group_size", "scheduler.staleness_bound", "scheduler.groups_per_step"):
            cfg.scheduler[k.split(".")[1]] = int(v)
    a.root = a.root or tempfile.mkdtemp(prefix="gyre_chaos_")
    os.makedirs(a.root, exist_ok=True)
    rng = random.Random(a.seed)
    t0 = time.monotonic()
    rows, trials = [], []
    faults = [f"{x}:{_fault_n(x, a, rng)}" for x in sites]
    for i in range(a.trials + a.disk_full + len(faults)):
        disk = i >= a.trials and i < a.trials + a.disk_full
        fault = faults[i - a.trials - a.disk_full] if i >= a.trials + a.disk_full else None
        t = run_trial(i, a, rng, rows, disk_mb=rng.uniform(1.5, 4.0) if disk else None, fault=fault)
        mode_dirs = [os.path.join(t["workdir"], d) for d in os.listdir(t["workdir"])
                     if os.path.isdir(os.path.join(t["workdir"], d, "store"))]
        t["audit"] = (audit_workdir(mode_dirs[0], group_size=cfg.scheduler.group_size,
                                    staleness_bound=cfg.scheduler.staleness_bound) if mode_dirs else None)
        if t["disk_mb"] is not None:
            try:
                if a.keep:
                    shutil.copytree(t["workdir"], t["workdir"] + ".saved", symlinks=True,
                                    ignore=shutil.ignore_patterns("*.sock"))  # the proxy socket cannot be copied
            finally:
                subprocess.run(["umount", t["workdir"]], check=False)
        trials.append(t)
        au = t["audit"] or {}
        print(f"trial {i} done ({'disk full' if disk else fault or 'stops'}): completed={t['completed']} "  # progress
              f"attempts={t['attempts']} hangs={t['hangs']} lost={au.get('rollouts_lost')} "
              f"twice={au.get('rollouts_trained_twice')} short={au.get('groups_short')} "
              f"{t.get('fault_result', '')}", file=sys.stderr, flush=True)
    wall = time.monotonic() - t0

    print(f"{'trial':>5} {'att':>3} {'stop':<34} {'at_s':>6} {'rc':>5} {'stop_s':>6} {'steps':>5}  last line")
    for r in rows:
        print(f"{r['trial']:>5} {r['attempt']:>3} {r['stop']:<34} {r['at_s']:>6} {str(r['rc']):>5} "
              f"{'' if r['stop_s'] is None else r['stop_s']:>6} {r['steps_seen']:>5}  {r['last']}")
    keys = ("finished", "trained", "dropped", "rollouts_lost", "rollouts_trained_twice", "groups_short", "wrong_state",
            "staleness_max", "infra_errors", "unfinished", "metrics_steps", "duplicate_steps", "replayed_steps",
            "oversized_steps", "params_hash_equal", "params_hash_differ")
    print()
    print(f"{'trial':>5} {'done':>5} " + " ".join(f"{k:>{max(6, len(k))}}" for k in keys))
    for i, t in enumerate(trials):
        au = t["audit"] or {}
        if au.get("over_bound_examples"):
            print(f"trial {i}: trained past the staleness bound (rollout, step, "
                  f"versions): {au['over_bound_examples']}")
        print(f"{i:>5} {str(t['completed']):>5} " + " ".join(f"{str(au.get(k, '-')):>{max(6, len(k))}}" for k in keys))

    def total(k):
        return sum((t["audit"] or {}).get(k, 0) for t in trials)

    out = dict(
        trials=len(trials), disk_full_trials=a.disk_full, kills=sum(t["kill9"] + t["sigterm"] for t in trials), kill9=sum(t["kill9"] for t in trials),
        sigterm=sum(t["sigterm"] for t in trials), resumes=sum(t["resumes"] for t in trials),
        restarts=sum(t["restarts"] for t in trials),
        rollouts_lost=total("rollouts_lost"), rollouts_trained_twice=total("rollouts_trained_twice"),
        groups_short=total("groups_short"), wrong_state=total("wrong_state"),
        max_staleness_over_bound=max(((t["audit"] or {}).get("max_staleness_over_bound", 0) for t in trials), default=0),
        staleness_bound=cfg.scheduler.staleness_bound, duplicate_steps=total("duplicate_steps"),
        steps_short=sum(a.steps - (t["audit"] or {}).get("metrics_steps", 0) for t in trials if t["completed"]),
        replayed_steps=total("replayed_steps"), params_hash_equal=total("params_hash_equal"),
        params_hash_differ=total("params_hash_differ"),
        oversized_steps=total("oversized_steps"), extra_groups=total("extra_groups"),
        infra_errors=total("infra_errors"), write_faults=sum(t["write_faults"] for t in trials), hangs=sum(t["hangs"] for t in trials),
        leftover_processes=sum(t["leftover_processes"] for t in trials),
        write_fault_sites=sites,
        write_fault_results={t["fault_result"]["site"]: dict(
            t["fault_result"], completed=t["completed"], **{k: (t["audit"] or {}).get(v) for k, v in (
                ("lost", "rollouts_lost"), ("twice", "rollouts_trained_twice"), ("short", "groups_short"))})
            for t in trials if t.get("fault_result")},
        unresumable_workdirs=sum(not t["completed"] for t in trials),
        failed_attempts=sum(len(t["failed_rc"]) for t in trials), finished_rollouts=total("finished"),
        wall_s=round(wall, 1), steps=a.steps, sft_steps=a.sft_steps, checkpoint_every=a.checkpoint_every,
        groups_per_step=cfg.scheduler.groups_per_step, group_size=cfg.scheduler.group_size, seed=a.seed,
        fake_engines=a.fake_engines,
        root=a.root,
    )
    if not a.keep:
        shutil.rmtree(a.root, ignore_errors=True)
        out["root"] = None
    return bench.emit(out, sizes=dict(trials=a.trials, kills=a.kills, steps=a.steps, sft_steps=a.sft_steps,
                                      checkpoint_every=a.checkpoint_every, groups_per_step=cfg.scheduler.groups_per_step,
                                      group_size=cfg.scheduler.group_size, seed=a.seed))


if __name__ == "__main__":
    main()
