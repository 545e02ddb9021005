"""The errors a job raises to the launcher, each printed as one line, and the exit codes.

``ConfigError``: a config value is wrong (the message starts with its dotted
name, e.g. ``config.scheduler.serve_reserve``); raised before any JAX work.
``RunFailed``: the run hit a failure it cannot survive, after saving what it
could; the message says what failed and that rerunning the command resumes.
``StorageError``: our own storage failed (disk full, I/O error, a read-only
remount) while writing under the workdir. It is never a rollout's failure: the
run stops naming the path, no rollout is recorded as failed because of it, and a
rerun (once there is room) resumes.

Exit codes of ``python -m launch.main`` (``EXIT_*`` below): 0 done; 1 the run
failed (``error:`` line; rerun resumes); 2 a bad config or command line; 3 our
storage failed (``error:`` line naming the path; free space, rerun resumes);
130 / 143 stopped by Ctrl-C / SIGTERM (``stopped:`` line; rerun resumes).
"""

EXIT_FAILED = 1
EXIT_CONFIG = 2
EXIT_STORAGE = 3
EXIT_INTERRUPTED = 130
EXIT_TERMINATED = 143


class ConfigError(ValueError):
    pass


class RunFailed(RuntimeError):
    pass


class Stopped(KeyboardInterrupt):
    """SIGTERM (or SIGINT) asked the run to stop: the loop saves what it trained and the process exits."""

    def __init__(self, signum: int):
        import signal
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


class StorageError(RunFailed):
    """A write under the workdir failed (ENOSPC, EIO, EROFS...); ``path`` names the file."""

    def __init__(self, path: str, what: str, cause: BaseException):
        reason = getattr(cause, "strerror", None) or str(cause) or type(cause).__name__
        super().__init__(f"storage failed: {what} {path}: {reason}")
        self.path, self.what = path, what


def storage_error(path: str, what: str, cause: BaseException) -> StorageError:
    """``cause`` as a StorageError (kept as is when it already is one)."""
    return cause if isinstance(cause, StorageError) else StorageError(path, what, cause)
