"""A stop while the entry point starts: one ``stopped:`` line and the documented exit code at once.

Until ``launch.main`` hands over to the job, Python's defaults would answer: SIGTERM kills the process
with no line (rc -15: a shell says 143, a supervisor sees a signal death), SIGINT raises
KeyboardInterrupt out of whatever import runs (a traceback). The imports (absl, then JAX inside
``main``) and JAX's start take seconds, and nothing is written before the job runs, so there is nothing
to save: the handler exits with the code a stop during the job gets (gyre_jax.errors: 143 / 130).
Installed first, before the heavy imports; only the interpreter's own start-up (tens of ms, no code of
ours) comes before it. Stdlib and gyre_jax.errors only: importing this must stay instant.
"""
import os
import signal
import sys

from gyre_jax.errors import EXIT_INTERRUPTED, EXIT_TERMINATED

CODES = {signal.SIGTERM: EXIT_TERMINATED, signal.SIGINT: EXIT_INTERRUPTED}


def _stop(signum, frame) -> None:
    try:  # what was printed so far, then the line; a flush cut short by the signal is not worth a traceback
        sys.stdout.flush()
    except Exception:  # noqa: BLE001
        pass
    line = f"stopped: {signal.Signals(signum).name} while starting, before the job ran (nothing written); " \
           "rerun the same command\n"
    os.write(2, line.encode())
    os._exit(CODES[signum])


def install() -> None:
    """Answer SIGTERM and SIGINT with ``_stop`` until ``launch.main`` installs the job's handlers."""
    for s in CODES:
        signal.signal(s, _stop)
