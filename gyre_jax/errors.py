"""The two errors a job raises to the launcher, each printed as one line.

``ConfigError``: a config value is wrong (the message starts with its dotted
name, e.g. ``config.scheduler.serve_reserve``); raised before any JAX work.
``RunFailed``: the run hit a failure it cannot survive, after saving what it
could; the message says what failed and that rerunning the command resumes.
"""


class ConfigError(ValueError):
    pass


class RunFailed(RuntimeError):
    pass
