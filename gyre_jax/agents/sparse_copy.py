"""Copy a file's data extents only: a sparse file (all holes, a planted 100 GB ``truncate``) costs
what it holds, not its apparent size. Used by the workspace snapshot (graders.py) and the graded
tree (graded_tree.py)."""

from __future__ import annotations

import errno
import os


def copy_extents(fd: int, out: int, size: int, budget: int) -> int | None:
    """Copy ``fd``'s data extents below ``size`` into ``out`` at the same offsets; the data
    bytes copied, or None once they pass ``budget``."""
    pos, copied = 0, 0
    while pos < size:
        try:
            start = os.lseek(fd, pos, os.SEEK_DATA)
            end = min(os.lseek(fd, start, os.SEEK_HOLE), size)
        except OSError as e:
            if e.errno == errno.ENXIO:  # only holes from pos to the end
                break
            start, end = pos, size  # no SEEK_DATA here: all of it is data
        if start >= size:
            break
        os.lseek(fd, start, os.SEEK_SET)
        os.lseek(out, start, os.SEEK_SET)
        left = end - start
        while left > 0:
            chunk = os.read(fd, min(left, 1 << 20))
            if not chunk:
                return copied
            copied += len(chunk)
            if copied > budget:
                return None
            os.write(out, chunk)
            left -= len(chunk)
        pos = end
    return copied
