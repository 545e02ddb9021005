"""The run report as a job (``config.job='report'``) and as a command beside it.

    python -m launch.main --config configs/learn.py --workdir /tmp/gyre_learn --config.job=report
    python -m gyre_jax.report /tmp/gyre_learn [--hf_path DIR] [--out DIR]

The job reads the run's own config (the same file and overrides the run was started with): its
tokenizer (``model.hf_path``, or the built-in byte tokenizer), its path selection and advantage
estimator (so the trained paths and advantages shown are the trainer's), its mode (which
``<workdir>/<mode>`` to report). The command needs only the workdir (every mode found in it; the
trainer's default selection and estimator, or ``--hf_path`` for a checkpoint's tokenizer).
Neither starts JAX work or touches the run: the store is opened read-only, so a report of a
running run is safe, and rerunning it brings the page up to date (only new rollouts cost time).
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys

from gyre_jax.report.build import ReportSettings, build_report, mode_dirs


def settings_from_config(config) -> tuple[ReportSettings, str]:
    """The report's settings and the mode from the run's config (``RLConfig``'s own parsing, so a field
    means for the report what it meant for the run)."""
    from gyre_jax.rl.config import RLConfig

    cfg = RLConfig.from_config(config)
    proc = cfg.train  # the train section is the processor's config
    return ReportSettings(tokenizer=f"hf:{cfg.hf_path}" if cfg.hf_path else "byte",
                          template_kwargs=dict(cfg.chat_template_kwargs), select=proc.select,
                          advantage=proc, group_field=proc.group_field,  # an AdvantageConfig too
                          staleness_bound=cfg.scheduler.staleness_bound), cfg.scheduler.mode


def run(config, workdir: str) -> dict:
    """Job 'report' (gyre_jax.jobs): the report of ``<workdir>/<mode>``; prints where it is and one JSON line."""
    from gyre_jax.errors import ConfigError

    settings, mode = settings_from_config(config)
    mode_dir = os.path.join(workdir, mode)
    if not mode_dirs(mode_dir):
        found = [os.path.basename(d) for d in mode_dirs(workdir)]
        raise ConfigError(f"config.scheduler.mode={mode!r}: no run in {mode_dir}"
                          + (f"; this workdir holds {found} (pass --config.scheduler.mode=...)" if found else ""))
    settings = dataclasses.replace(settings, title=f"{os.path.basename(os.path.normpath(workdir))}/{mode}")
    stats = build_report(mode_dir, settings=settings, start_method="spawn")  # launch.main started JAX: no fork
    _print(stats)
    return stats


def _print(stats: dict) -> None:
    print(f"report: {stats['report']} ({stats['rollouts']} rollouts, {stats['groups_built']} of {stats['groups']} "
          f"groups built, {stats['seconds']:.1f}s, {stats['bytes_total'] / 1e6:.1f} MB with the 1.2 MB plotly.js)",
          flush=True)
    print(json.dumps({"bench": "report", **stats}), flush=True)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m gyre_jax.report", description="Build a run's report (HTML, opens "
                                 "from disk) from its workdir: a running, finished or failed run.")
    ap.add_argument("workdir", help="the run's --workdir (every <mode> in it), a <workdir>/<mode>, or a bare store")
    ap.add_argument("--hf_path", default="", help="the checkpoint whose tokenizer decodes the calls (default: bytes)")
    ap.add_argument("--out", default="", help="where the page goes (default <mode dir>/report)")
    ap.add_argument("--quiet", action="store_true", help="no progress lines")
    ap.add_argument("--workers", type=int, default=0, help="processes building rollout files (0: one per CPU, "
                    "up to 8, for large runs)")
    args = ap.parse_args(argv)
    dirs = mode_dirs(args.workdir)
    if not dirs:
        print(f"error: {args.workdir}: no run here (no store/, metrics.jsonl or <mode>/ holding one)", file=sys.stderr)
        return 2
    for d in dirs:
        out = (os.path.join(args.out, os.path.basename(d)) if len(dirs) > 1 else args.out) if args.out else None
        settings = ReportSettings(tokenizer=f"hf:{args.hf_path}" if args.hf_path else "byte", title=os.path.normpath(d))
        _print(build_report(d, out, settings, progress=not args.quiet, workers=args.workers))
    return 0
