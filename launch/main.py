"""The one entry point: ``python -m launch.main --config configs/X.py [--workdir DIR]``.

Thin on purpose: parse flags, log where we run, hand the config to the job it
names. Every ``--config.a.b=value`` flag overrides a config field; a misspelled
field fails loudly (the config is locked).
"""
from absl import app, flags, logging
from ml_collections import config_flags

_CONFIG = config_flags.DEFINE_config_file("config", None, "Path to a configs/*.py file.", lock_config=True)
_WORKDIR = flags.DEFINE_string("workdir", None, "Directory for checkpoints, logs, metrics and plots.")
flags.mark_flags_as_required(["config"])


def main(argv):
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {argv[1:]}")
    from gyre_jax import jobs

    config = _CONFIG.value
    workdir = _WORKDIR.value or config.get("workdir", None) or f"/tmp/gyre_jax/{config.job}"
    job = jobs.get(config.job)
    logging.info("job=%s workdir=%s", config.job, workdir)
    job(config, workdir)


if __name__ == "__main__":
    app.run(main)
