"""The grain pipeline the RL trainer reads: batches of packed rows, a step at a time,
with Orbax-checkpointable state.

A batch is a dict of numpy arrays: every ``PackedRows`` field and ``rollout_index``
as [B, L] (an MoE run's ``routing`` [B, L, R] too: ``OPTIONAL_FIELDS``), plus per row ``step`` int32[B] and ``last_in_step`` bool[B] (all True in
the step's last batch, so the trainer knows when to apply the optimizer). Rows
that only fill up a step's last batch are empty padding rows (segment 0, weight 0),
so every batch has the same shape and jitted steps never recompile.

``StreamingDataset`` yields the rows a ``RowStream`` receives (``RowStream.add``) in
arrival order, a step at a time; ``end_step`` closes a step (its partial last
batch is padded). A batch that might be the step's last is held until more rows
arrive or the step ends, so ``last_in_step`` is exact. Within one added chunk the
rows are shuffled with a seed derived from (seed, step, chunk), so the order is a
pure function of (seed, sequence of adds). The loop adds in one of two ways
(``rl.trainer``):

  * whole steps (the batch modes, one-step): all rows of a finished step as one
    chunk, so the step is globally shuffled;
  * streamed groups (the streaming modes, and multi-step): a chunk per rollout
    group as it is taken into the running step, so rows reach the cells while
    later groups still run (no global shuffle).

The iterator's state is (step, row offset); after a step's last batch it is the
next step's start. Save it with ``grain.checkpoint.CheckpointSave(it)`` inside an
``ocp.CheckpointManager`` and restore into a fresh iterator with
``grain.checkpoint.CheckpointRestore(it2)``; then re-add the chunks of the steps
from the restored one on (the trajectory store holds their rollouts).
"""
from __future__ import annotations

import dataclasses
import threading
import time
from typing import Any

import grain
import numpy as np

from gyre_jax.trajectory.serialize import PackedRows, pack_rows

# Present in every chunk of a run or in none: routing [B, L, R] (an MoE run), adapter [B, L] (multi-LoRA)
OPTIONAL_FIELDS = ("routing", "adapter")
ROW_FIELDS = tuple(f.name for f in dataclasses.fields(PackedRows) if f.name not in OPTIONAL_FIELDS) + ("rollout_index",)


def _row_arrays(rows: PackedRows, rollout_index: np.ndarray) -> dict[str, np.ndarray]:
    d = rows.as_dict()
    d["rollout_index"] = np.asarray(rollout_index, np.int32)
    shapes = {k: v.shape for k, v in d.items() if k not in OPTIONAL_FIELDS}
    if len({s for s in shapes.values()}) != 1 or len(d["tokens"].shape) != 2:
        raise ValueError(f"packed rows must all be [B, L] arrays of one shape; got {shapes}")
    for k in OPTIONAL_FIELDS:
        if k in d and d[k].shape[:2] != d["tokens"].shape:
            raise ValueError(f"packed rows: {k} has shape {d[k].shape}, tokens {d['tokens'].shape}")
    return d


def _pad_like(batch: dict[str, np.ndarray], n: int, row_len: int) -> dict[str, np.ndarray]:
    """``n`` empty rows with the batch's fields (an MoE run's routing: all -1, routed live)."""
    pad = _empty_rows(n, row_len)
    if "routing" in batch:
        pad["routing"] = np.full((n, row_len, batch["routing"].shape[2]), -1, batch["routing"].dtype)
    if "adapter" in batch:
        pad["adapter"] = np.zeros((n, row_len), np.int32)
    return pad


def _empty_rows(n: int, row_len: int) -> dict[str, np.ndarray]:
    rows = pack_rows([[] for _ in range(n)], row_len)
    return _row_arrays(rows, np.full((n, row_len), -1, np.int32))


def _derive_seed(*parts: int) -> int:
    return int(np.random.SeedSequence([int(p) for p in parts]).generate_state(1)[0])


class RowStream:
    """Thread-safe, append-only rows per step; producers ``add``, the iterator waits."""

    def __init__(self, row_len: int):
        self.row_len = int(row_len)
        self._cond = threading.Condition()
        self._chunks: dict[int, list[dict[str, np.ndarray]]] = {}
        self._counts: dict[int, int] = {}
        self._ended: set[int] = set()
        self._closed = False

    def add(self, step: int, rows: PackedRows, rollout_index: np.ndarray) -> None:
        arrays = _row_arrays(rows, rollout_index)
        if arrays["tokens"].shape[1] != self.row_len:
            raise ValueError(f"RowStream.add(step={step}): rows of length {arrays['tokens'].shape[1]}, stream row_len={self.row_len}")
        with self._cond:
            if step in self._ended or self._closed:
                raise ValueError(f"RowStream.add: step {step} already ended (or the stream is closed); rows would be lost")
            self._chunks.setdefault(step, []).append(arrays)
            self._counts[step] = self._counts.get(step, 0) + arrays["tokens"].shape[0]
            self._cond.notify_all()

    def end_step(self, step: int) -> None:
        with self._cond:
            self._ended.add(step)
            self._cond.notify_all()

    def close(self) -> None:
        """No more steps: an iterator waiting for a step that never came stops."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()

    def take(self, step: int, row: int, batch_size: int, seed: int, deadline: float | None):
        """The next rows of the stream at or after (``step``, ``row``), waiting for producers.

        Returns ``(step, lo, hi, rows, last)``: rows [lo, hi) of ``step`` in stream order (chunks
        shuffled by ``seed``), at most ``batch_size`` of them, and whether they end the step. Only a
        full batch with rows after it, or the tail of an ended step, is returned. Raises
        StopIteration once the stream is closed with nothing left, TimeoutError past ``deadline``.
        """
        with self._cond:
            while True:
                have = self._counts.get(step, 0)
                ended = step in self._ended
                if have > row + batch_size:
                    break  # a full batch with rows after it: not the step's last
                if ended:
                    if row < have:
                        break  # the step's remaining rows; the last batch is padded
                    step, row = step + 1, 0  # step done (or empty)
                    continue
                if self._closed:
                    raise StopIteration
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    raise TimeoutError(
                        f"StreamingDataset: timed out waiting for rows {row}..{row + batch_size} of step {step} "
                        f"(have {have}); did the producer call end_step?"
                    )
                self._cond.wait(left)
            hi = min(row + batch_size, have)
            rows = self._rows(step, row, hi, seed)
        return step, row, hi, rows, ended and hi == have

    def _rows(self, step: int, lo: int, hi: int, seed: int) -> dict[str, np.ndarray]:
        """Rows [lo, hi) of the step in stream order (chunks shuffled by their seed)."""
        parts, off = [], 0
        for c, chunk in enumerate(self._chunks[step]):
            n = chunk["tokens"].shape[0]
            a, b = max(lo, off), min(hi, off + n)
            if a < b:
                perm = np.random.default_rng(_derive_seed(seed, step, c)).permutation(n)
                sel = perm[a - off : b - off]
                parts.append({k: v[sel] for k, v in chunk.items()})
            off += n
        keys = set(parts[0])
        if any(set(p) != keys for p in parts):
            raise ValueError(f"RowStream: step {step}'s chunks carry different fields (routing in some, not others)")
        return {k: np.concatenate([p[k] for p in parts]) for k in keys}


class StreamingDataset(grain.IterDataset):
    """Batches of rows from a ``RowStream``, a step at a time (module docstring)."""

    def __init__(self, stream: RowStream, *, batch_size: int, seed: int, start_step: int = 0,
                 timeout_s: float | None = None):
        super().__init__()
        if batch_size < 1:
            raise ValueError(f"StreamingDataset: batch_size={batch_size} must be >= 1")
        self._stream, self._b, self._seed = stream, int(batch_size), int(seed)
        self._start, self._timeout = int(start_step), timeout_s

    def __iter__(self) -> "_StreamIterator":
        return _StreamIterator(self._stream, self._b, self._seed, self._start, self._timeout)


class _StreamIterator(grain.DatasetIterator):
    def __init__(self, stream: RowStream, batch_size: int, seed: int, step: int, timeout_s):
        super().__init__()
        self._s, self._b, self._seed, self._timeout = stream, batch_size, seed, timeout_s
        self._step, self._row = step, 0

    def get_state(self) -> dict[str, Any]:
        return {"step": int(self._step), "row": int(self._row)}

    def set_state(self, state: dict[str, Any]) -> None:
        self._step, self._row = int(state["step"]), int(state["row"])

    def __next__(self) -> dict[str, np.ndarray]:
        self._assert_not_closed()
        deadline = None if self._timeout is None else time.monotonic() + self._timeout
        self._step, lo, hi, batch, last = self._s.take(self._step, self._row, self._b, self._seed, deadline)
        self._row = lo
        if hi - self._row < self._b:
            pad = _pad_like(batch, self._b - (hi - self._row), self._s.row_len)
            batch = {k: np.concatenate([batch[k], pad[k]]) for k in batch}
        batch["step"] = np.full(self._b, self._step, np.int32)
        batch["last_in_step"] = np.full(self._b, last)
        # After a step's last batch the position is the next step's start, so a checkpoint
        # taken between steps restores onto a stream that only holds the steps to come.
        self._step, self._row = (self._step + 1, 0) if last else (self._step, hi)
        return batch
