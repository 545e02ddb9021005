"""The run report: one self-contained HTML page per run, built from its workdir (``report.build``).

``python -m launch.main --config <the run's config> --workdir W --config.job=report`` (or
``python -m gyre_jax.report W``) writes ``W/<mode>/report/index.html``: reward and held-out eval
curves per policy version, per-task pass rates and their change, statuses and the top failure reasons
per step with an example log, the cells' role timeline, and every rollout as its tree (calls,
branch points, the trained paths, decoded prompts and completions, grader output, advantage,
staleness), searchable. Data modules: ``run_data`` (metrics, evals, attempts), ``rollouts`` (one
rollout, from the trainer's own tree rebuild and path selection), ``decode`` (ids to role-tagged text).
"""
from gyre_jax.report.build import ReportSettings, build_report, mode_dirs

__all__ = ["ReportSettings", "build_report", "mode_dirs"]
