"""Every extension point of the package: ``python -m gyre_jax.plugins`` lists each registry's entries.

Each is a ``gyre_jax.registry.Registry``, picked from a config by the field it names
(``--config.train.loss``, ``--config.harness.kind`` ...); an entry's options are
``--config.<section>.<field>_options.<entry>.<option>``.
"""
from __future__ import annotations

from gyre_jax.registry import Registry


def all_registries() -> dict[str, Registry]:
    """Every registry, by the config field that picks from it (imports their homes, not their entries')."""
    from gyre_jax import jobs, losses
    from gyre_jax.agents import harnesses, tasks
    from gyre_jax.agents.tasks import formats
    from gyre_jax.rl import metrics
    from gyre_jax.scheduler import modes

    regs = (losses.POLICY_LOSSES, losses.ADVANTAGE_ESTIMATORS, losses.MISMATCH_CORRECTIONS, losses.WEIGHT_BUILDERS,
            harnesses.HARNESS_KINDS, tasks.FAMILIES, formats.TASK_FORMATS, metrics.METRIC_SINKS,
            modes.SCHEDULING_MODES, jobs.JOBS)
    return {r.flag: r for r in regs}


def main() -> None:
    for flag, reg in all_registries().items():
        print(f"{reg.kind} (--config.{flag}):")
        for e in reg.entries():
            opts = f" [options: {', '.join(e.options())}]" if e.options() else ""
            print(f"  {e.name}: {e.summary}{' (' + e.paper + ')' if e.paper else ''}{opts}")


if __name__ == "__main__":
    main()
