"""The demo's three modes on the tiny_tests family: elastic vs colocate vs async, for real.

  python tools/bench_demo_modes.py [--steps 8] [--repeats 1] [--workdir /tmp/gyre_bench_modes] [--run_tests_scale 1.0]

Each mode runs ``python -m launch.main --config configs/demo.py`` in its own process (one
after the other, same workdir, same seed, same steps and overrides) on the 'tiny_tests'
family: every rollout writes its answer, then calls ``run_tests``, a real sandboxed
subprocess that takes 1-30 s of wall time (heavy-tailed, per task; median 3 s). While
the suites run the rollouts hold no decode slot: elastic can hand those cells to
training, colocate cannot train until the whole batch is in, async trains on a fixed
cell. The held-out eval is off (it runs one model call without the suites, so it would
not measure this family) and contexts are 192 tokens (the transcript with run_tests is
~107 tokens after a ~60-token prompt).

Throughput = trained rollouts per second of the RL phase (``rl_s`` in summary.json: from
the controller's start to the last step's end; the SFT warm start, compiles and imports
before it are the same in every mode and left out). Every mode trains the same
``steps x groups_per_step x group_size`` rollouts, so the ratios are also rl_s ratios.
Prints a table, then ONE final JSON line:

  elastic_vs_colocate, elastic_vs_async   throughput ratios (elastic / baseline; > 1: elastic faster), of
                                          each mode's median round with --repeats; *_by_round: every round's.
                                          With --modes ...,async_stream also elastic_vs_async_stream: async with
                                          streaming, so the ratio is the role switching's share alone
  seconds_<mode>, rl_seconds_<mode>       whole process / RL phase per mode
  rollouts_per_s_<mode>, tested_fraction_<mode> (finished rollouts that ran their suite), reward_last_<mode>
  after_last_group_s_<mode>               mean per step: training left once the step's last group was in (the
                                          streaming modes train each group as it is taken; the batch modes,
                                          colocate and async, the whole step after its last group)
  suite_bound_rl_s_<mode>, of_suite_bound_<mode>   the RL phase with free compute (only the suites and the
                                          staleness bound cost time: ``suite_bound_rl_s`` simulates it with
                                          the same policy and tasks), and bound / measured: how close a mode
                                          is to what no scheduler can beat on this machine
  steps, groups_per_step, group_size, run_tests_scale, repeats, load_avg_{before,after}_<mode> (median round)

The machine is shared: the load average before and after each mode is in the JSON, and
a ratio measured beside other jobs says how the modes compare under that load.
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import benchkit

MODES = ("elastic", "colocate", "async")
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# What the family needs of the demo config (not tuned per mode: every mode runs these).
FAMILY_OVERRIDES = (
    "--config.task.family=tiny_tests",
    "--config.eval.every=0",
    "--config.model.max_seq_len=192", "--config.cells.max_len=192", "--config.train.row_len=192",
    "--config.harness.max_tokens=120",
    "--config.progress=False",
)


def mode_flags(mode: str, args) -> list[str]:
    """The --config.* overrides every mode's run gets (and the free-compute bound reads)."""
    return [f"--config.scheduler.mode={mode}", f"--config.steps={args.steps}",
            f"--config.scheduler.groups_per_step={args.groups_per_step}",
            f"--config.scheduler.group_size={args.group_size}",
            f"--config.task.family_options.tiny_tests.run_tests_scale={args.run_tests_scale}", f"--config.sft.steps={args.sft_steps}",
            *FAMILY_OVERRIDES, *args.extra]


def run_mode(mode: str, args) -> dict:
    workdir = os.path.join(args.workdir, mode)
    shutil.rmtree(workdir, ignore_errors=True)  # a fresh run, not a resume
    cmd = [sys.executable, "-m", "launch.main", "--config", "configs/demo.py", "--workdir", args.workdir,
           *mode_flags(mode, args)]
    load_before = os.getloadavg()[0]
    log_path = os.path.join(args.workdir, f"{mode}.log")
    print(f"[{mode}] {' '.join(cmd[1:])}\n[{mode}] log: {log_path} (load {load_before:.2f})", flush=True)
    with open(log_path, "w") as log:
        proc, seconds = benchkit.timed(subprocess.run, cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT)
    if proc.returncode != 0:
        with open(log_path) as f:
            tail = f.read()[-3000:]
        raise SystemExit(f"error: mode {mode} exited with {proc.returncode}; log tail:\n{tail}")
    with open(os.path.join(args.workdir, mode, "summary.json")) as f:
        summary = json.load(f)
    commands = 0  # sandbox_commands is the run's running total: its last value counts every suite run
    tails = []  # per step: training left once its last group was in (streaming: the last group's rows + update)
    with open(os.path.join(args.workdir, mode, "metrics.jsonl")) as f:
        for line in f:
            rec = json.loads(line)
            commands = max(commands, int(rec.get("sandbox_commands", 0)))
            tails.append(float(rec["after_last_group_s"]))
    rollouts = summary["steps"] * args.groups_per_step * args.group_size
    finished = sum(summary["statuses"].values()) or 1
    out = {"mode": mode, "seconds": seconds, "rl_s": summary["rl_s"], "steps": summary["steps"], "rollouts": rollouts,
           "rollouts_per_s": rollouts / summary["rl_s"], "tested_fraction": commands / finished,
           "reward_last": summary["reward_last"], "util_rollout": summary["util_rollout"],
           "util_train": summary["util_train"], "util_train_busy": summary["util_train_busy"],
           "switches": summary["switches"], "after_last_group_s": sum(tails) / max(len(tails), 1),
           "load_before": load_before, "load_after": os.getloadavg()[0]}
    print(f"[{mode}] {seconds:.0f} s, RL phase {summary['rl_s']:.1f} s, {out['rollouts_per_s']:.3f} rollouts/s, "
          f"{out['tested_fraction']:.2f} of rollouts ran their suite", flush=True)
    return out


def suite_bound_rl_s(args, mode: str) -> float:
    """The RL phase with free compute: the same tasks' suites in launch order (every rollout
    tests; the suite time is per task, so a group's rollouts share it), every model call,
    training step, switch and publication instant, the run's own policy config (from the same
    config file and overrides) admitting groups on its cells. What only the suites and the staleness
    bound cost: no scheduler can finish this run's RL phase faster (up to the ~10% of
    rollouts that skip their suite)."""
    from absl import flags
    from ml_collections import config_flags

    from gyre_jax.agents.tasks import test_suite
    from gyre_jax.rl.config import RLConfig
    from gyre_jax.scheduler import simulator
    from gyre_jax.scheduler.workloads import ClusterConfig, Rollouts, SimConfig, WorkloadConfig

    # The run's config as launch.main reads it: the same file and overrides, parsed by the same flags.
    argv = ["bench", f"--config={os.path.join(ROOT, 'configs', 'demo.py')}", *mode_flags(mode, args)]
    fv = flags.FlagValues()
    config_flags.DEFINE_config_file("config", None, "", flag_values=fv, sys_argv=argv)  # overrides come from argv
    fv(argv)
    cfg = RLConfig.from_config(fv.config)
    k, groups = cfg.scheduler.group_size, cfg.steps * cfg.scheduler.groups_per_step
    offsets, call_s, tool_s, tokens = [0], [], [], []
    for g in range(groups):
        suite_s = test_suite(cfg.group_task(g)).duration_s
        for _ in range(k):  # one model call, the suite, the finishing call
            call_s += [1e-6, 1e-6]
            tool_s += [suite_s, 0.0]
            tokens += [1.0, 1.0]
            offsets.append(len(call_s))
    free = dict(decode_tok_s=1e9, prefill_tok_s=1e9, train_tokens_per_s_per_cell=1e9, optimizer_s=0.0)
    workload = WorkloadConfig(name="demo_suites", calls_median=2, calls_shape=1.0, calls_max=2, decode_tokens_median=1,
                              decode_tokens_sigma=0.0, context_tokens_median=1, context_tokens_sigma=0.0,
                              tool_s_median=1.0, tool_s_sigma=0.0, **free)
    n_cells = cfg.check_devices(cfg.num_cpu_devices)
    cluster = ClusterConfig(accelerators=n_cells, cell_size=1, slots_per_cell=cfg.cells.max_slots,
                            switch_to_train_s=0.0, switch_to_rollout_s=0.0, kv_move_s=0.0, publish_s=0.0)
    policy = cfg.scheduler  # the loop's own policy config (a PolicyConfig), priors included
    rollouts = Rollouts(offsets=offsets, call_s=call_s, tool_s=tool_s, tokens=tokens)
    return simulator.simulate(SimConfig(cluster=cluster, workload=workload, policy=policy), rollouts=rollouts,
                              record_decisions=False).makespan_s


def main(argv=None) -> dict:
    bench = benchkit.Bench(__file__, __doc__, quick=dict(steps=1, groups_per_step=1, group_size=2, sft_steps=5,
                                                        run_tests_scale=0.05, modes="elastic"))
    ap = bench.parser
    ap.add_argument("--steps", type=int, default=8, help="RL steps per mode")
    ap.add_argument("--groups_per_step", type=int, default=8)
    ap.add_argument("--group_size", type=int, default=8)
    ap.add_argument("--sft_steps", type=int, default=600, help="supervised warm start (the policy must learn to "
                    "call run_tests)")
    ap.add_argument("--run_tests_scale", type=float, default=1.0, help="x every suite's 1-30 s")
    ap.add_argument("--modes", default=",".join(MODES))
    ap.add_argument("--workdir", default="/tmp/gyre_bench_modes")
    ap.add_argument("--repeats", type=int, default=1, help="rounds of every mode, interleaved (elastic, colocate, "
                    "async, elastic, ...) so a slow spell of the machine hits every mode; the ratios use each "
                    "mode's median round (the slower middle one of an even count)")
    ap.add_argument("extra", nargs="*", help="more --config.* overrides, after --")
    args = bench.parse(argv)
    modes = [m for m in args.modes.split(",") if m]
    os.makedirs(args.workdir, exist_ok=True)
    if args.repeats < 1:
        raise SystemExit(f"error: --repeats={args.repeats} must be >= 1")
    rounds: list[dict] = []
    for r in range(args.repeats):
        if args.repeats > 1:
            print(f"round {r + 1} of {args.repeats}", flush=True)
        rounds.append({m: run_mode(m, args) for m in modes})
    # Each mode's median round by throughput (its whole row: the table stays one consistent run).
    res = {m: sorted((rd[m] for rd in rounds), key=lambda x: x["rollouts_per_s"])[(len(rounds) - 1) // 2]
           for m in modes}

    cols = ["mode", "seconds", "rl_s", "rollouts", "rollouts_per_s", "tested_fraction", "reward_last", "util_rollout",
            "util_train", "util_train_busy", "switches", "after_last_group_s", "load_before", "load_after"]
    rows = [cols] + [[f"{r[c]:.3f}" if isinstance(r[c], float) else str(r[c]) for c in cols] for r in res.values()]
    widths = [max(len(row[i]) for row in rows) for i in range(len(cols))]
    print()
    for row in rows:
        print("  ".join(v.rjust(w) for v, w in zip(row, widths)))

    final = {"throughput": "trained rollouts per second of the RL phase (rl_s)", "steps": args.steps,
             "groups_per_step": args.groups_per_step, "group_size": args.group_size,
             "run_tests_scale": args.run_tests_scale, "sft_steps": args.sft_steps, "extra_overrides": args.extra,
             "repeats": args.repeats}
    for m, r in res.items():
        bound = suite_bound_rl_s(args, m)
        final.update({f"suite_bound_rl_s_{m}": round(bound, 1), f"of_suite_bound_{m}": round(bound / r["rl_s"], 3)})
        final.update({f"seconds_{m}": round(r["seconds"], 1), f"rl_seconds_{m}": round(r["rl_s"], 1),
                      f"rollouts_per_s_{m}": round(r["rollouts_per_s"], 4),
                      f"tested_fraction_{m}": round(r["tested_fraction"], 3),
                      f"reward_last_{m}": round(r["reward_last"], 3), f"switches_{m}": r["switches"],
                      f"after_last_group_s_{m}": round(r["after_last_group_s"], 3),
                      f"load_avg_before_{m}": round(r["load_before"], 2), f"load_avg_after_{m}": round(r["load_after"], 2)})
    if "elastic" in res:
        for base in ("colocate", "async", "async_stream"):
            if base in res:
                final[f"elastic_vs_{base}"] = round(res["elastic"]["rollouts_per_s"] / res[base]["rollouts_per_s"], 3)
                final[f"elastic_vs_{base}_by_round"] = [
                    round(rd["elastic"]["rollouts_per_s"] / rd[base]["rollouts_per_s"], 3) for rd in rounds]
    return bench.emit(final, sizes=dict(steps=args.steps, groups_per_step=args.groups_per_step, group_size=args.group_size,
                                        run_tests_scale=args.run_tests_scale, sft_steps=args.sft_steps, modes=modes,
                                        repeats=args.repeats))


if __name__ == "__main__":
    main()
