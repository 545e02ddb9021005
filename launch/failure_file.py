"""Where a failed run's traceback goes: a file in the workdir that its one ``error:`` line names.

A failure is one line on stderr (what failed, what to do); the traceback (the whole chain of causes,
and any notes the job added, e.g. a checkpoint after the failure that could not be saved) is
appended to ``<workdir>/errors.log`` under a header with the time, the process and the line's text.
The workdir's disk may be the one that failed: then the temp directory's ``gyre-errors-<pid>.log``,
and if neither can be written the line says so instead of printing the traceback.
"""
from __future__ import annotations

import os
import tempfile
import time
import traceback

FILE_NAME = "errors.log"


def save(workdir: str, error: BaseException) -> str:
    """Append ``error``'s traceback to the workdir's errors.log; the line's suffix naming where it went."""
    text = "".join(traceback.format_exception(error))
    header = f"==== {time.strftime('%Y-%m-%dT%H:%M:%S')} pid {os.getpid()}: {type(error).__name__}: {error}\n"
    why = ""
    for path in (os.path.join(workdir, FILE_NAME), os.path.join(tempfile.gettempdir(), f"gyre-errors-{os.getpid()}.log")):
        try:
            with open(path, "a") as f:
                f.write(header + text + "\n")
            return f" (traceback: {path})"
        except OSError as e:
            why = why or (e.strerror or str(e))
    return f" (traceback not saved: {why})"
