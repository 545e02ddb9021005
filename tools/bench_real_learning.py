"""A real pretrained model learning through an unchanged harness, measured (issue 45).

  python tools/bench_real_learning.py [--steps 8] [--modes elastic] [--eval_every 2] [--eval_tasks 64]
                                      [--eval_samples 2] [--workdir /tmp/gyre_bench_real] [--set KEY=VALUE ...]

Each mode is one ``python -m launch.main --config configs/smol_agent.py`` process: SmolLM2-135M-Instruct
from its GGUF file, every rollout one ``examples/harnesses/shell_agent.py`` process in its sandbox talking to
the recording proxy, the held-out split of examples/tasks/smol_tasks.jsonl run as whole episodes through the
same harness before the first step (the base model), every ``--eval_every`` steps and after the last. A
rerun of the same command resumes unfinished runs and reuses finished ones.

Writes ``<workdir>/real_learning.png`` (held-out pass@1 with its 95% interval against RL wall time and
policy version, one line per mode; the base model's level dashed) and prints the eval curve and the
per-step time split, then ONE final JSON line:

  base_pass1, base_pass_at_k     the base model's held-out pass@1 and pass@k (k = --eval_samples); an episode
                                 that failed to score (timeout without a grade, infra error) counts as failed
  final_pass1, final_pass_at_k   the same at the last evaluated version
  gain, ci95                     final_pass1 - base_pass1, and the 95% interval of that difference (paired over
                                 the held-out tasks: each task's pass rate at both versions; normal approximation)
  base_ci95                      the 95% interval half-width of base_pass1 over tasks
  gain_significant               the interval excludes 0
  never_solved, always_solved    held-out tasks the base model solved in none / all of its samples
  curve                          [[version, rl_s, pass1, pass_at_k], ...] per evaluated version (first mode)
  steps, wall_s, s_per_step      RL steps done, this bench's wall time, RL seconds per step (mean)
  setup_s                        seconds from the process start to the first step's start (load, compiles)
  time_split_s                   per step (mean): prefill and decode (engine seconds), model_calls (agents
                                 waiting on the model), tools (agents' own time outside model calls),
                                 grading, packing (the trainer's tree packing), training (the step itself)
  gen_tokens_per_s, train_tokens_per_s   means over the steps
  peak_rss_gb, planned_host_gb   the run's peak RSS (its process's ru_maxrss) and the memory plan's host figure

``--quick`` is a smoke run of this bench (2 steps, 2 held-out tasks, 1 sample, 1 group of 2): it loads the
real model and compiles its steps, so it takes minutes; tests/test_tools.py lists it as not quick-testable.
The machine may be shared: the load average at the start of each run is printed with it.
"""
from __future__ import annotations

import json
import math
import os
import resource
import subprocess
import sys
import time

import benchkit

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONFIG = os.path.join(ROOT, "configs", "smol_agent.py")
QUICK = ("eval.tasks=2", "eval.samples_per_task=1", "scheduler.groups_per_step=1", "scheduler.group_size=2")


def _jsonl(path: str) -> list[dict]:
    if not os.path.isfile(path):
        return []
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def run_one(workdir: str, mode: str, overrides: list[str], log_path: str) -> float:
    argv = [sys.executable, "-m", "launch.main", f"--config={CONFIG}", f"--workdir={workdir}",
            f"--config.scheduler.mode={mode}", "--config.progress=False", *[f"--config.{o}" for o in overrides]]
    with open(log_path, "a") as log:
        proc, seconds = benchkit.timed(subprocess.run, argv, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT)
    if proc.returncode != 0:
        with open(log_path) as f:
            tail = f.read()[-3000:]
        raise SystemExit(f"bench_real_learning: {mode} exited {proc.returncode}; the end of {log_path}:\n{tail}")
    return seconds


def task_passes(run_dir: str, version: int, pass_score: float = 1.0) -> dict[str, list[int]]:
    """Held-out task id -> 0/1 per episode at ``version`` (an episode without a score is a 0)."""
    out: dict[str, list[int]] = {}
    for r in _jsonl(os.path.join(run_dir, "eval", f"v{version:06d}", "episodes.jsonl")):
        s = r.get("score")
        out.setdefault(r["task_id"], []).append(int(s is not None and s >= pass_score))
    return out


def pass_at_k(n: int, c: int, k: int) -> float:
    return 1.0 if n - c < k else 1.0 - math.comb(n - c, k) / math.comb(n, k)


def summarize(passes: dict[str, list[int]], k: int) -> dict:
    """pass@1 (mean over tasks of each task's pass rate), its 95% half-width over tasks, pass@k."""
    rates = [sum(x) / len(x) for x in passes.values() if x]
    n = len(rates)
    if not n:
        return {"pass1": None, "ci95": None, "pass_at_k": None, "tasks": 0}
    mean = sum(rates) / n
    sd = math.sqrt(sum((r - mean) ** 2 for r in rates) / (n - 1)) if n > 1 else 0.0
    pk = [pass_at_k(len(x), sum(x), min(k, len(x))) for x in passes.values() if x]
    return {"pass1": mean, "ci95": 1.96 * sd / math.sqrt(n), "pass_at_k": sum(pk) / len(pk), "tasks": n}


def paired_gain(base: dict[str, list[int]], final: dict[str, list[int]]) -> tuple[float | None, float | None]:
    """(mean over tasks of final - base pass rate, its 95% half-width): the same tasks at two versions."""
    d = [sum(final[t]) / len(final[t]) - sum(base[t]) / len(base[t]) for t in base if base[t] and final.get(t)]
    if len(d) < 2:
        return (d[0] if d else None), None
    m = sum(d) / len(d)
    sd = math.sqrt(sum((x - m) ** 2 for x in d) / (len(d) - 1))
    return m, 1.96 * sd / math.sqrt(len(d))


SPLIT = (("prefill", "time/prefill_s"), ("decode", "time/decode_s"), ("model_calls", "time/model_calls_s"),
         ("tools", "time/tools_s"), ("grading", "time/grading_s"), ("packing", "process_s"),
         ("training", "train_step_s"))


def read_run(run_dir: str, k: int) -> dict:
    steps = _jsonl(os.path.join(run_dir, "metrics.jsonl"))
    evals = _jsonl(os.path.join(run_dir, "eval", "eval.jsonl"))
    t_of = {0: 0.0, **{r["version"]: r["time_s"] for r in steps if "version" in r and "time_s" in r}}
    curve, passes = [], {}
    for e in evals:
        v = int(e["step"])
        passes[v] = task_passes(run_dir, v)
        s = summarize(passes[v], k)
        curve.append([v, t_of.get(v), s["pass1"], s["pass_at_k"], s["ci95"]])
    with open(os.path.join(run_dir, "summary.json")) as f:
        summary = json.load(f)
    mean = lambda key: (sum(r.get(key, 0.0) for r in steps) / len(steps)) if steps else None  # noqa: E731
    split = {name: mean(key) for name, key in SPLIT}
    per_step = [r["time_s"] - p for r, p in zip(steps, [0.0] + [r["time_s"] for r in steps])]
    return {"curve": sorted(curve), "passes": passes, "summary": summary, "split": split, "steps": len(steps),
            "s_per_step": sum(per_step) / len(per_step) if per_step else None,
            "gen_tokens_per_s": mean("gen_tokens_per_s"), "train_tokens_per_s": mean("train_tokens_per_s")}


def plot(runs: dict, base: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_t, ax_v) = plt.subplots(1, 2, figsize=(11, 4), sharey=True)
    for mode, run in runs.items():
        c = [p for p in run["curve"] if p[2] is not None]
        for ax, x in ((ax_t, [p[1] or 0.0 for p in c]), (ax_v, [p[0] for p in c])):
            ax.errorbar(x, [p[2] for p in c], yerr=[p[4] or 0.0 for p in c], marker="o", capsize=3, label=mode)
    for ax in (ax_t, ax_v):
        if base.get("pass1") is not None:
            ax.axhline(base["pass1"], color="gray", linestyle="--", linewidth=1, label="base model")
        ax.grid(alpha=0.3)
    ax_t.set_xlabel("RL wall time (s)")
    ax_v.set_xlabel("policy version (optimizer steps)")
    ax_t.set_ylabel("held-out pass@1 (whole episodes, 95% CI over tasks)")
    ax_v.legend(fontsize=8)
    fig.suptitle("SmolLM2-135M-Instruct through shell_agent.py: held-out pass@1")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def planned_host_gb(overrides: list[str]) -> float | None:
    """The memory plan's host figure for the same config (``--plan=cpu:N``; nothing starts)."""
    argv = [sys.executable, "-m", "launch.main", f"--config={CONFIG}", "--plan=cpu:2",
            *[f"--config.{o}" for o in overrides]]
    out = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True).stdout
    line = next((ln for ln in out.splitlines() if ln.startswith("host: ")), "")
    try:
        return float(line.split()[1]) * (1 << 30) / 1e9
    except (IndexError, ValueError):
        return None


def setup_seconds(log_path: str) -> float | None:
    """The launcher's 'setup N s' of the last run in the log (load, compiles, engines warmed)."""
    found = None
    if os.path.isfile(log_path):
        with open(log_path) as f:
            for line in f:
                if ", setup " in line:
                    try:
                        found = float(line.split(", setup ")[1].split("s")[0])
                    except ValueError:
                        pass
    return found


def main(argv=None) -> dict:
    bench = benchkit.Bench(__file__, __doc__, quick={"steps": 2}, quick_help="2 steps, 2 held-out tasks (minutes)")
    ap = bench.parser
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--modes", default="elastic", help="comma-separated scheduler modes, e.g. elastic,colocate")
    ap.add_argument("--eval_every", type=int, default=2)
    ap.add_argument("--eval_tasks", type=int, default=64)
    ap.add_argument("--eval_samples", type=int, default=2)
    ap.add_argument("--workdir", default="/tmp/gyre_bench_real")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                    help="a config override for every run, e.g. --set train.learning_rate=1e-5")
    a = bench.parse(argv)
    modes = [m.strip() for m in a.modes.split(",") if m.strip()]
    overrides = [f"steps={a.steps}", f"eval.every={a.eval_every}", f"eval.tasks={a.eval_tasks}",
                 f"eval.samples_per_task={a.eval_samples}", f"checkpoint_every={a.eval_every}"]
    overrides += [*QUICK] if a.quick else []
    overrides += a.set
    k = 1 if a.quick else a.eval_samples
    os.makedirs(a.workdir, exist_ok=True)
    t0 = time.monotonic()
    runs, loads = {}, {}
    for i, mode in enumerate(modes):
        loads[mode] = os.getloadavg()[0]
        print(f"bench_real_learning: run {i + 1}/{len(modes)}: {mode} (load {loads[mode]:.1f}, "
              f"{time.monotonic() - t0:.0f}s so far)", flush=True)
        log_path = os.path.join(a.workdir, f"{mode}.log")
        run_one(a.workdir, mode, overrides, log_path)
        runs[mode] = read_run(os.path.join(a.workdir, mode), k)
        runs[mode]["setup_s"] = setup_seconds(log_path)
        # The largest child's peak RSS so far (the launcher's process; kB on Linux).
        runs[mode]["peak_rss_gb"] = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024 / 1e9
    first = runs[modes[0]]
    v0, vn = first["curve"][0][0], first["curve"][-1][0]
    base, final = summarize(first["passes"][v0], k), summarize(first["passes"][vn], k)
    gain, ci = paired_gain(first["passes"][v0], first["passes"][vn])
    rates = [sum(x) / len(x) for x in first["passes"][v0].values() if x]
    png = os.path.join(a.workdir, "real_learning.png")
    plot(runs, base, png)
    f = lambda x, p=3: "-" if x is None else f"{x:.{p}f}"  # noqa: E731
    for mode, run in runs.items():
        print(f"\n{mode} (load {loads[mode]:.1f} at its start): held-out pass@1 per version")
        print(f"{'version':>7} {'rl_s':>7} {'pass@1':>7} {'+-95%':>6} {f'pass@{k}':>7}")
        for v, t, p1, pk, c95 in run["curve"]:
            print(f"{v:>7} {f(t, 0):>7} {f(p1):>7} {f(c95):>6} {f(pk):>7}")
        print("time per step (s, summed over what ran in it): "
              + ", ".join(f"{name} {f(run['split'][name], 1)}" for name, _ in SPLIT))
    print(f"plot: {png}")
    result = {"base_pass1": base["pass1"], "base_pass_at_k": base["pass_at_k"], "base_ci95": base["ci95"],
              "final_pass1": final["pass1"], "final_pass_at_k": final["pass_at_k"], "final_version": vn,
              "gain": gain, "ci95": ci, "gain_significant": None if ci is None else abs(gain) > ci,
              "never_solved": sum(r == 0 for r in rates), "always_solved": sum(r == 1 for r in rates),
              "eval_tasks": base["tasks"], "k": k, "curve": [c[:4] for c in first["curve"]],
              "steps": first["steps"], "wall_s": time.monotonic() - t0, "s_per_step": first["s_per_step"],
              "setup_s": first["setup_s"], "time_split_s": first["split"],
              "gen_tokens_per_s": first["gen_tokens_per_s"], "train_tokens_per_s": first["train_tokens_per_s"],
              "peak_rss_gb": first["peak_rss_gb"], "planned_host_gb": planned_host_gb(overrides),
              "modes": modes, "loads": loads,
              "by_mode": {m: {"final_pass1": r["curve"][-1][2], "s_per_step": r["s_per_step"], "steps": r["steps"]}
                          for m, r in runs.items()}}
    return bench.emit(result, sizes=dict(steps=a.steps, eval_tasks=a.eval_tasks, eval_samples=k, modes=modes,
                                         overrides=overrides, model="SmolLM2-135M-Instruct (GGUF Q4_1 -> f32)"))


if __name__ == "__main__":
    main()
