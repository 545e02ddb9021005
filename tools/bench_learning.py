"""Time-to-quality, mode against mode, on long branching rollouts (issue 26).

  python tools/bench_learning.py [--seeds 0,1] [--modes elastic,async,colocate] [--steps 30]
                                 [--workdir /tmp/gyre_bench_learning] [--quick] [--set KEY=VALUE ...]

Each (seed, mode) is one ``python -m launch.main --config configs/learn.py`` process, one after
the other, with the same tasks, seed, staleness bound and warm start (trained once per seed
and shared through ``--config.sft.cache_dir``): the 'tiny_agent' family, whose episodes read,
write, test (or delegate the test run to a sub-agent) and get compacted, and whose warm start
tests its answer in only 30% of its demonstrations. The held-out eval runs whole episodes of
fixed tasks at fixed sampling seeds through the run's own harness (eval/eval.jsonl).
Rerunning the same command resumes unfinished runs and reuses finished ones.

Writes ``<workdir>/learning.png`` (held-out eval vs RL wall time and vs step, one line per
mode and seed, the warm start's level dashed) and prints a table, then ONE final JSON line:

  eval_gain_<mode>                     final held-out eval minus the warm start's (mean over seeds)
  eval_final_<mode>, eval_warm_start   the levels themselves (mean over seeds)
  final_eval_spread                    max - min over modes of the final eval (mean over seeds); per seed in
                                       final_eval_spread_by_seed
  warm_eval_spread                     max - min over modes of the v0 eval: the SAME params in each run, so
                                       the eval's own run-to-run spread (load, timeouts, numerics)
  final_eval_se                        the final eval's standard error from its episodes' sampling (fixed
                                       tasks: within-task variance; eval/v<version>/episodes.jsonl)
  eval_noise, final_spread_within_noise   max(warm_eval_spread, 1.96*sqrt(2)*final_eval_se), and whether every
                                       seed's final spread is within it: the modes "match" as far as the
                                       eval can tell
  time_to_target_s_<mode>              RL seconds until the eval first reaches the target, the warm start plus
                                       90% of the smallest mode's gain (per seed, then the mean); None: never
  time_to_target_colocate_over_elastic, time_to_target_async_over_elastic   ratios of those means
  rl_s_<mode>                          the RL phase's wall time (summary.json rl_s; mean over seeds)
  branching_rollout_fraction, dedup_factor_real   from the elastic runs' records (summary.json trees)
  steps, groups_per_step, group_size, seeds, modes, eval_tasks, eval_samples, params, wall_s

Times are the RL phase only (from the controller's start; imports, compiles and the warm start
are the same in every mode). The machine may be shared: the load average at the start of each
run is in the table.
"""
from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import time

import benchkit

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONFIG = os.path.join(ROOT, "configs", "learn.py")
QUICK = ("steps=2", "sft.steps=20", "eval.every=1", "eval.tasks=1", "eval.samples_per_task=2",
         "scheduler.groups_per_step=2", "scheduler.group_size=4", "task.family_options.tiny_agent.run_tests_scale=0.02", "checkpoint_every=2")


def _jsonl(path: str) -> list[dict]:
    if not os.path.isfile(path):
        return []
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def _setting(overrides: list[str], key: str) -> int:
    """What the runs used for an integer config field: the last override of it wins (as in launch.main's
    flags), else configs/learn.py's value."""
    given = [o.split("=", 1)[1] for o in overrides if o.split("=", 1)[0] == key]
    if given:
        return int(given[-1])
    import importlib.util

    spec = importlib.util.spec_from_file_location("_learn", CONFIG)
    assert spec is not None and spec.loader is not None, CONFIG
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    value = mod.get_config()
    for part in key.split("."):
        value = value[part]
    return int(value)


def run_one(workdir: str, mode: str, seed: int, overrides: list[str], log_path: str) -> float:
    argv = [sys.executable, "-m", "launch.main", f"--config={CONFIG}", f"--workdir={workdir}",
            f"--config.scheduler.mode={mode}", f"--config.seed={seed}", "--config.progress=False",
            f"--config.sft.cache_dir={os.path.join(os.path.dirname(workdir), 'sft_cache')}",
            *[f"--config.{o}" for o in overrides]]
    with open(log_path, "a") as log:
        proc, seconds = benchkit.timed(subprocess.run, argv, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT)
    rc = proc.returncode
    if rc != 0:
        with open(log_path) as f:
            tail = f.read()[-3000:]
        raise SystemExit(f"bench_learning: {mode} seed {seed} exited {rc}; the end of {log_path}:\n{tail}")
    return seconds


def read_run(run_dir: str) -> dict:
    """The curve (version -> RL seconds, eval) and the summary of one finished run."""
    steps = _jsonl(os.path.join(run_dir, "metrics.jsonl"))
    evals = {r["step"]: r["eval/reward"] for r in _jsonl(os.path.join(run_dir, "eval", "eval.jsonl"))}
    t_of = {0: 0.0, **{r["version"]: r["time_s"] for r in steps if "version" in r and "time_s" in r}}
    curve = sorted((v, t_of[v], e) for v, e in evals.items() if v in t_of)
    with open(os.path.join(run_dir, "summary.json")) as f:
        summary = json.load(f)
    episodes = {}  # version -> task id -> scores of its scored episodes (eval/v<version>/episodes.jsonl)
    for v in evals:
        path = os.path.join(run_dir, "eval", f"v{v:06d}", "episodes.jsonl")
        if os.path.exists(path):
            by_task: dict[str, list[float]] = {}
            for r in _jsonl(path):
                if r.get("score") is not None:
                    by_task.setdefault(r["task_id"], []).append(float(r["score"]))
            episodes[v] = by_task
    return {"curve": curve, "summary": summary, "episodes": episodes}


def eval_se(by_task: dict[str, list[float]]) -> float | None:
    """Standard error of an eval's mean score from its episodes' sampling alone: the held-out tasks are the
    same in every run, so only the within-task variance counts (sum_t n_t s_t^2 / N^2)."""
    n = sum(len(xs) for xs in by_task.values())
    if n == 0 or any(len(xs) < 2 for xs in by_task.values()):
        return None
    var = sum(len(xs) * sum((x - sum(xs) / len(xs)) ** 2 for x in xs) / (len(xs) - 1) for xs in by_task.values())
    return math.sqrt(var) / n


def time_to(curve, target: float) -> float | None:
    return next((t for _, t, e in curve if e >= target - 1e-12), None)


def _mean(xs):
    xs = [x for x in xs if x is not None and not (isinstance(x, float) and math.isnan(x))]
    return sum(xs) / len(xs) if xs else None


def analyse(runs: dict[tuple[int, str], dict], seeds, modes) -> dict:
    out: dict = {}
    per_seed_spread, ttt = [], {m: [] for m in modes}
    warm, finals = [], {m: [] for m in modes}
    for s in seeds:
        w = _mean([runs[s, m]["curve"][0][2] for m in modes if runs[s, m]["curve"] and runs[s, m]["curve"][0][0] == 0])
        warm.append(w)
        fin = {m: runs[s, m]["curve"][-1][2] for m in modes}
        for m in modes:
            finals[m].append(fin[m])
        per_seed_spread.append(max(fin.values()) - min(fin.values()))
        target = w + 0.9 * min(fin[m] - w for m in modes)
        for m in modes:
            ttt[m].append(time_to(runs[s, m]["curve"], target))
    out["eval_warm_start"] = _mean(warm)
    for m in modes:
        out[f"eval_final_{m}"] = _mean(finals[m])
        out[f"eval_gain_{m}"] = _mean([f - w for f, w in zip(finals[m], warm)])
        reached = [t for t in ttt[m] if t is not None]
        out[f"time_to_target_s_{m}"] = _mean(reached) if len(reached) == len(seeds) else None
        out[f"rl_s_{m}"] = _mean([runs[s, m]["summary"].get("rl_s") for s in seeds])
    out["final_eval_spread"] = max(out[f"eval_final_{m}"] for m in modes) - min(out[f"eval_final_{m}"] for m in modes)
    out["final_eval_spread_by_seed"] = per_seed_spread
    # What "match" can mean: the same params evaluated in each mode's run (its warm start, v0) spread this much,
    # and two evals' means differ by up to 1.96 * sqrt(2) * SE by episode sampling alone (95%).
    v0 = [[runs[s, m]["curve"][0][2] for m in modes if runs[s, m]["curve"] and runs[s, m]["curve"][0][0] == 0]
          for s in seeds]
    out["warm_eval_spread"] = _mean([max(x) - min(x) for x in v0 if len(x) == len(modes)])
    ses = [eval_se(runs[s, m].get("episodes", {}).get(runs[s, m]["curve"][-1][0], {}))
           for s in seeds for m in modes if runs[s, m]["curve"]]
    out["final_eval_se"] = max(ses) if ses and all(x is not None for x in ses) else None
    noise = [x for x in (out["warm_eval_spread"], out["final_eval_se"] and 1.96 * math.sqrt(2) * out["final_eval_se"])
             if x is not None]
    out["eval_noise"] = max(noise) if noise else None
    out["final_spread_within_noise"] = (max(per_seed_spread) <= out["eval_noise"]) if noise else None
    for m in modes:
        if m != "elastic" and "elastic" in modes:
            a, b = out[f"time_to_target_s_{m}"], out["time_to_target_s_elastic"]
            out[f"time_to_target_{m}_over_elastic"] = a / b if a and b else None
    if "elastic" in modes:
        trees = [runs[s, "elastic"]["summary"].get("trees", {}) for s in seeds]
        out["branching_rollout_fraction"] = _mean([t.get("branching_rollout_fraction") for t in trees])
        out["dedup_factor_real"] = _mean([t.get("dedup_factor_real") for t in trees])
    return out


def plot(runs, seeds, modes, warm: float | None, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_t, ax_v) = plt.subplots(1, 2, figsize=(11, 4), sharey=True)
    colors = dict(zip(modes, ("tab:blue", "tab:orange", "tab:green", "tab:red", "tab:purple")))
    for s in seeds:
        for m in modes:
            c = runs[s, m]["curve"]
            style = dict(color=colors[m], linestyle="-" if s == seeds[0] else ":", marker="o", markersize=3,
                         label=f"{m} (seed {s})")
            ax_t.plot([t for _, t, _ in c], [e for _, _, e in c], **style)
            ax_v.plot([v for v, _, _ in c], [e for _, _, e in c], **style)
    for ax in (ax_t, ax_v):
        if warm is not None:
            ax.axhline(warm, color="gray", linestyle="--", linewidth=1, label="warm start")
        ax.grid(alpha=0.3)
    ax_t.set_xlabel("RL wall time (s)")
    ax_v.set_xlabel("policy version (optimizer steps)")
    ax_t.set_ylabel("held-out eval (mean score, whole episodes)")
    ax_v.legend(fontsize=7)
    fig.suptitle("tiny_agent: held-out eval by mode")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv=None) -> dict:
    bench = benchkit.Bench(__file__, __doc__, quick_help="a smoke run: tiny sizes, one seed")
    ap = bench.parser
    ap.add_argument("--seeds", default="0,1")
    ap.add_argument("--modes", default="elastic,async,colocate")
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--workdir", default="/tmp/gyre_bench_learning")
    ap.add_argument("--warm_seed", type=int, default=-1,
                    help="one warm start (this seed's) for every seed: the spread over RL seeds alone; -1: one per seed")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                    help="a config override for every run, e.g. --set train.learning_rate=2e-4")
    a = bench.parse(argv)
    seeds = [int(s) for s in a.seeds.split(",")][: 1 if a.quick else None]
    modes = [m.strip() for m in a.modes.split(",") if m.strip()]
    overrides = ([*QUICK] if a.quick else [f"steps={a.steps}"]) + [f"sft.seed={a.warm_seed}"] + a.set
    os.makedirs(a.workdir, exist_ok=True)
    t0 = time.monotonic()
    runs, rows = {}, []
    total = len(seeds) * len(modes)
    for i, (s, m) in enumerate((s, m) for s in seeds for m in modes):
        wd = os.path.join(a.workdir, f"seed{s}")
        load = os.getloadavg()[0]
        elapsed = time.monotonic() - t0
        eta = f", ETA {elapsed / i * (total - i):.0f}s" if i else ""
        print(f"bench_learning: run {i + 1}/{total}: {m} seed {s} (load {load:.1f}, {elapsed:.0f}s so far{eta})",
              flush=True)
        secs = run_one(wd, m, s, overrides, os.path.join(a.workdir, f"seed{s}_{m}.log"))
        runs[s, m] = read_run(os.path.join(wd, m))
        c, summ = runs[s, m]["curve"], runs[s, m]["summary"]
        rows.append((m, s, secs, summ.get("rl_s"), c[0][2] if c else None, c[-1][2] if c else None, load,
                     summ.get("trees", {}).get("branching_rollout_fraction")))
    result = analyse(runs, seeds, modes)
    png = os.path.join(a.workdir, "learning.png")
    plot(runs, seeds, modes, result["eval_warm_start"], png)
    print(f"\n{'mode':10} {'seed':>4} {'proc_s':>7} {'rl_s':>7} {'eval v0':>8} {'eval end':>8} {'load':>5} {'branching':>9}")
    f = lambda x, p=3: "-" if x is None else f"{x:.{p}f}"  # noqa: E731
    for m, s, secs, rl_s, e0, e1, load, br in rows:
        print(f"{m:10} {s:>4} {secs:7.0f} {f(rl_s, 0):>7} {f(e0):>8} {f(e1):>8} {load:5.1f} {f(br, 2):>9}")
    print(f"plot: {png}")
    s0 = runs[seeds[0], modes[0]]["summary"]
    result.update(steps=_setting(overrides, "steps"), seeds=seeds, modes=modes, quick=a.quick, overrides=overrides,
                  groups_per_step=_setting(overrides, "scheduler.groups_per_step"),
                  group_size=_setting(overrides, "scheduler.group_size"),
                  trained_rollouts=s0.get("trees", {}).get("trained_rollouts"), wall_s=time.monotonic() - t0)
    return bench.emit(result, sizes=dict(steps=result["steps"], seeds=seeds, modes=modes,
                                         groups_per_step=result["groups_per_step"], group_size=result["group_size"],
                                         overrides=overrides))


if __name__ == "__main__":
    main()
