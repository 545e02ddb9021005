"""One atomic Orbax checkpoint per saved step: train state, RNG, data position, store cursor, buffer.

Items of one checkpoint (``<directory>/<step>/<item>``), written by one
``ocp.CheckpointManager.save`` and finalized by one rename, so a reader sees all
of them from the same step or none:

  state   the train state pytree (params, optimizer state, step, policy version;
          any pytree of jax arrays), ``StandardSave``; restored against an
          abstract target whose leaves carry the *new* shardings, so a run
          resumes on a different cell layout.
  rng     (optional) a JAX PRNG key (typed, any impl, or raw uint32) as JSON of its
          uint32 key data: exact, and not tied to the device that held it. The RL
          loop keeps none: every key it uses derives from config.seed.
  data    the grain iterator's position (``grain.checkpoint.CheckpointSave``),
          if the loop has one.
  cursor  ``TrajectoryStore.cursor_state()``: every rollout consumed (trained or
          dropped) by the updates that are in ``state``.
  buffer  ids of finished-but-untrained rollouts the loop held (their records
          live in the durable store; only ids go here), in the loop's order.
  meta    a small JSON of loop metadata (the caller's) plus our format version.

Why "no finished rollout lost, none trained twice" holds across a crash
(``kill -9`` at any instant):

  * The loop marks rollouts trained in the store *after* the update that used
    them, and checkpoints the cursor in the same atomic checkpoint as the params
    that include those updates. So, in every checkpoint, a rollout is
    "consumed" in ``cursor`` iff its update is in ``state``.
  * the store's persisted cursor (``cursor.json`` + journal) may run ahead of the last checkpoint (rollouts
    marked after it). On restore, ``resume_store`` replaces it with the
    checkpoint's cursor: those rollouts become pending again and are trained once
    in the resumed lineage, the only lineage whose params survive.
  * A rollout that finished after the checkpoint is in the durable store (the
    proxy appends it before it counts as finished), not consumed by the
    checkpoint's cursor, so ``store.pending_rollouts()`` returns it: not lost.
    ``resume_store`` returns the buffer (in its saved order) followed by those.
  * A torn save never shows: Orbax writes into a temporary directory and renames
    it when every item is written; ``latest_step`` only sees finalized steps, and
    the temporary directories of a killed save are removed on the next open.

The loop's protocol (what the resume test in tests/test_checkpoint_resume.py runs)::

    ck = Checkpointer(CheckpointConfig(directory=f"{workdir}/ckpt"))
    r = ck.restore_latest(abstract_like(spec.abstract_state(), spec.state_shardings(mesh)),
                          data_iterator=it)        # None on a fresh run
    if r: state, rng, start = r.train_state, r.rng, r.step; buffer = resume_store(store, r)
    metrics = MetricsWriter(workdir, purge_step=start)   # hides the crashed attempt's steps
    for step in range(start, num_steps):
        buffer += newly finished rollout ids (already durable in the store)
        take, buffer = pick(buffer)                 # what this update trains on
        state = train(state, take)
        store.mark_trained(take, step=step)         # after the update, before the save
        ck.save(step + 1, train_state=state, rng=rng, store_cursor=store.cursor_state(),
                buffer=buffer, data_iterator=it, meta={...})

``restored.step`` is the number of completed steps (the next step to run).

Keep ``max_to_keep >= 2`` when saving asynchronously: the previous checkpoint
must survive until the next one is finalized (Orbax deletes only after that).
"""
from __future__ import annotations

import dataclasses
import errno
import logging
import os
import re
from typing import Any, Mapping, Sequence

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp

from gyre_jax.errors import StorageError

log = logging.getLogger(__name__)

FORMAT = "gyre-checkpoint"
FORMAT_VERSION = 1
ITEMS = ("state", "rng", "data", "cursor", "buffer", "meta")


@dataclasses.dataclass(frozen=True, kw_only=True)
class CheckpointConfig:
    directory: str  # absolute or relative; made absolute (Orbax needs that)
    max_to_keep: int = 3  # most recent checkpoints kept; older ones deleted after a newer one is final
    save_interval_steps: int = 1  # save when step % save_interval_steps == 0 (or force=True)
    async_save: bool = False  # write in a background thread; device->host copy still happens in save()
    # Multi-process runs: False = every process calls save with global arrays (one SPMD program);
    # True = this process alone saves its own arrays (pods: the core owns the state, satellites never save).
    this_process_only: bool = False

    def __post_init__(self):
        w = "CheckpointConfig"
        if not isinstance(self.directory, (str, os.PathLike)) or not str(self.directory):
            raise ValueError(f"{w}.directory must be a non-empty path, got {self.directory!r}")
        if not isinstance(self.max_to_keep, int) or self.max_to_keep < 1:
            raise ValueError(f"{w}.max_to_keep must be an int >= 1, got {self.max_to_keep!r}")
        if self.async_save and self.max_to_keep < 2:
            raise ValueError(f"{w}.max_to_keep must be >= 2 with async_save (the last final checkpoint must survive)")
        if not isinstance(self.save_interval_steps, int) or self.save_interval_steps < 1:
            raise ValueError(f"{w}.save_interval_steps must be an int >= 1, got {self.save_interval_steps!r}")


@dataclasses.dataclass(frozen=True)
class Restored:
    step: int
    train_state: Any  # laid out on the shardings of the abstract target
    rng: jax.Array | None  # None if the checkpoint holds no key
    store_cursor: dict  # pass to resume_store (or TrajectoryStore.restore_cursor)
    buffer: list  # rollout ids, finished and untrained at save time, in the loop's order
    meta: dict  # the caller's loop metadata as saved


def abstract_like(tree, shardings=None):
    """ShapeDtypeStruct tree with shardings: the restore target for a new layout.

    ``tree``: arrays or ShapeDtypeStructs (e.g. ``StateSpec.abstract_state()``).
    ``shardings``: a matching tree of ``jax.sharding.Sharding`` (e.g.
    ``StateSpec.state_shardings(new_mesh)``); if None, each leaf's own sharding.
    """
    if shardings is None:
        return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=getattr(x, "sharding", None)), tree)
    return jax.tree.map(
        lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
        tree,
        shardings,
        is_leaf=lambda x: isinstance(x, jax.ShapeDtypeStruct),
    )


def _rng_to_json(rng) -> dict:
    rng = jnp.asarray(rng) if not isinstance(rng, jax.Array) else rng
    if jnp.issubdtype(rng.dtype, jax.dtypes.prng_key):
        impl, data = str(jax.random.key_impl(rng)), np.asarray(jax.random.key_data(rng))
    elif rng.dtype == jnp.uint32:
        impl, data = None, np.asarray(rng)  # a raw jax.random.PRNGKey
    else:
        raise ValueError(f"Checkpointer.save: rng must be a JAX PRNG key (typed or uint32), got dtype {rng.dtype}")
    return {"impl": impl, "shape": list(data.shape), "key_data": data.reshape(-1).tolist()}


def _rng_from_json(d) -> jax.Array:
    data = np.asarray(d["key_data"], np.uint32).reshape(d["shape"])
    return jnp.asarray(data) if d["impl"] is None else jax.random.wrap_key_data(jnp.asarray(data), impl=d["impl"])


def _check_target(abstract) -> None:
    """Every leaf must say where it goes; a missing sharding would fall back to the saved layout."""
    missing = [
        jax.tree_util.keystr(path)
        for path, leaf in jax.tree_util.tree_leaves_with_path(abstract)
        if getattr(leaf, "sharding", None) is None
    ]
    if missing:
        raise ValueError(
            f"restore target leaves without a sharding: {missing[:5]}{' ...' if len(missing) > 5 else ''} "
            f"({len(missing)} of them); build the target with abstract_like(abstract, new_shardings)"
        )


def _check_global(tree, this_process_only: bool = False) -> None:
    """Multi-process: every process calls save; each array must be one global array over all of them
    (unless this process alone saves its own arrays: ``CheckpointConfig.this_process_only``)."""
    if jax.process_count() == 1 or this_process_only:
        return
    local = [
        jax.tree_util.keystr(path)
        for path, leaf in jax.tree_util.tree_leaves_with_path(tree)
        if isinstance(leaf, jax.Array) and leaf.is_fully_addressable
    ]
    if local:
        raise ValueError(
            f"Checkpointer.save with {jax.process_count()} processes: leaves {local[:5]} are process-local arrays; "
            "put them on the global mesh (e.g. replicated NamedSharding(mesh, P())) so one checkpoint holds them"
        )


def _check_buffer(buffer, cursor) -> list[str]:
    ids = list(buffer)
    bad = [r for r in ids if not isinstance(r, str) or not r]
    if bad:
        raise ValueError(f"checkpoint buffer: rollout ids must be non-empty strings, got {bad[:5]}")
    if len(set(ids)) != len(ids):
        dup = sorted({r for r in ids if ids.count(r) > 1})
        raise ValueError(f"checkpoint buffer: rollout ids listed twice: {dup[:5]}")
    both = sorted(set(ids) & set(cursor.get("consumed", {})))
    if both:
        raise ValueError(f"checkpoint buffer: rollouts both buffered and consumed in the cursor: {both[:5]}")
    return ids


# Our disk failing under a save: Orbax passes tensorstore's failures on as ValueError text
# ("RESOURCE_EXHAUSTED: ... No space left on device [os_error_code='28']"), plain OSErrors as they are.
_STORAGE_ERRNOS = (errno.ENOSPC, errno.EIO, errno.EROFS, errno.EDQUOT, errno.EFBIG)
_OS_ERROR_CODE = re.compile(r"os_error_code='?(\d+)")


def _storage_errno(e: BaseException | None) -> int | None:
    """The errno of a storage failure anywhere in ``e``'s chain, or None if it is no storage failure."""
    seen = set()
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        if isinstance(e, OSError) and e.errno in _STORAGE_ERRNOS:
            return e.errno
        m = _OS_ERROR_CODE.search(str(e))
        if m and int(m.group(1)) in _STORAGE_ERRNOS:
            return int(m.group(1))
        e = e.__cause__ or e.__context__
    return None


def _as_storage_error(directory: str, e: BaseException) -> BaseException:
    """``e`` as a StorageError naming the checkpoint directory when our disk failed, else ``e``."""
    if isinstance(e, StorageError):
        return e
    code = _storage_errno(e)
    if code is None:
        return e
    os_error = OSError(code, os.strerror(code))
    os_error.__cause__ = e  # the Orbax/tensorstore text stays in the traceback
    err = StorageError(directory, "writing a checkpoint in", os_error)
    err.__cause__ = os_error  # what the loop's error: line names (its strerror, not tensorstore's whole text)
    return err


class _ThreadErrorsInOneLine(logging.Filter):
    """Orbax's save threads log their failure with its traceback (``_SignalingThread.run() raised``), then the
    save raises the same error to us, and the run's error line names the file that keeps its traceback: the
    log keeps their one line (a full disk printed one traceback per thread per save attempt)."""

    def filter(self, record: logging.LogRecord) -> bool:
        if record.exc_info and "orbax" in (record.pathname or ""):
            record.exc_info, record.exc_text = None, None
        return True


_ONE_LINE = _ThreadErrorsInOneLine()


class Checkpointer:
    """Save every ``save_interval_steps`` steps, keep ``max_to_keep``, restore onto any layout."""

    def __init__(self, config: CheckpointConfig):
        logging.getLogger("absl").addFilter(_ONE_LINE)  # Orbax logs through absl (idempotent: a set)
        self.config = config
        self.directory = os.path.abspath(os.fspath(config.directory))
        import grain  # here, not at import: the checkpoint module stays light for the loss-only paths

        # A handler per item, so reading metadata or restoring knows every item (without
        # them Orbax warns once per item per read that it "could not be restored").
        json_ = ocp.JsonCheckpointHandler
        # Pods: this process alone saves its own (host-local) arrays, as host copies.
        self._host_only = multi = jax.process_count() > 1 and config.this_process_only
        if multi:  # Orbax refuses create=True with active_processes set: the core makes the directory
            os.makedirs(self.directory, exist_ok=True)
        self._mngr = ocp.CheckpointManager(
            self.directory,
            item_handlers=dict(state=ocp.StandardCheckpointHandler(), rng=json_(), cursor=json_(), buffer=json_(),
                               meta=json_(), data=grain.checkpoint.CheckpointHandler()),
            options=ocp.CheckpointManagerOptions(
                max_to_keep=config.max_to_keep,
                save_interval_steps=config.save_interval_steps,
                enable_async_checkpointing=config.async_save,
                cleanup_tmp_directories=True,  # a save killed mid-write left one
                create=not multi,
                # Pods: only this process (the core) checkpoints; without this Orbax waits at barriers
                # for every process of the run, and satellite processes never save.
                multiprocessing_options=(ocp.options.MultiprocessingOptions(
                    primary_host=jax.process_index(), active_processes={jax.process_index()})
                    if multi else ocp.options.MultiprocessingOptions()),
            ),
        )

    # ------------------------------------------------------------------ save
    def should_save(self, step: int) -> bool:
        return self._mngr.should_save(int(step))

    def save(
        self,
        step: int,
        *,
        train_state,
        rng: jax.Array | None = None,
        store_cursor: Mapping[str, Any],
        buffer: Sequence[str] = (),
        data_iterator=None,
        meta: Mapping[str, Any] | None = None,
        force: bool = False,
    ) -> bool:
        """Save one checkpoint at ``step`` if due (or ``force``); returns whether it saved.

        Multi-process: every process calls it with the same arguments (a
        collective); arrays are global (each process writes its shards), the
        JSON items and the rng are written by process 0, the grain position per
        process.

        ``store_cursor`` must be ``store.cursor_state()`` taken *after* the
        rollouts used by the updates in ``train_state`` were marked trained, and
        ``buffer`` the finished rollouts not yet trained (module docstring).
        """
        if not isinstance(step, (int, np.integer)) or isinstance(step, bool) or step < 0:
            raise ValueError(f"Checkpointer.save: step must be an int >= 0, got {step!r}")
        step = int(step)
        if not force and not self._mngr.should_save(step):
            return False
        if not isinstance(store_cursor, Mapping) or "consumed" not in store_cursor:
            raise ValueError("Checkpointer.save: store_cursor must be TrajectoryStore.cursor_state() (a dict with 'consumed')")
        ids = _check_buffer(buffer, store_cursor)
        _check_global(train_state, self.config.this_process_only)
        meta = dict(meta or {})
        for k in ("format", "format_version", "step"):
            if k in meta:
                raise ValueError(f"Checkpointer.save: meta key {k!r} is reserved")
        meta.update(format=FORMAT, format_version=FORMAT_VERSION, step=step)
        if self._host_only:
            # Orbax serializes only global arrays in a multi-process run; this process's own arrays
            # (the core's sub-mesh) are written as host numpy copies and laid out again on restore.
            train_state = jax.device_get(train_state)
        items = dict(
            state=ocp.args.StandardSave(train_state),
            cursor=ocp.args.JsonSave(dict(store_cursor)),
            buffer=ocp.args.JsonSave({"rollout_ids": ids}),
            meta=ocp.args.JsonSave(meta),
        )
        if rng is not None:
            items["rng"] = ocp.args.JsonSave(_rng_to_json(rng))
        if data_iterator is not None:
            import grain  # only here: importing this module stays light for the loss-only paths

            items["data"] = grain.checkpoint.CheckpointSave(data_iterator)
        try:
            saved = self._mngr.save(step, args=ocp.args.Composite(**items), force=True)
        except Exception as e:  # a full disk is a StorageError (its own exit code, the path), not a failed run
            raise _as_storage_error(self.directory, e)  # noqa: B904 - its cause chain is set there
        if saved:
            log.info("checkpoint: saved step %d (%d buffered rollouts) to %s", step, len(ids), self.directory)
        return bool(saved)

    # ------------------------------------------------------------------ restore
    def latest_step(self) -> int | None:
        return self._mngr.latest_step()

    def all_steps(self) -> list[int]:
        return list(self._mngr.all_steps())

    def restore_latest(self, abstract_train_state, *, data_iterator=None, validate=None) -> Restored | None:
        """Restore the newest intact checkpoint, or None if there is none (fresh run).

        A checkpoint that fails to restore (damaged files) or that ``validate(restored)`` refuses
        (raises ValueError, e.g. its label is not its state's version) is skipped with a warning
        naming why, and the next older one is tried; if none is intact, the newest one's error is
        raised (a run never silently starts fresh over checkpoints it could not read).
        """
        steps = sorted(self.all_steps(), reverse=True)
        if not steps:
            log.info("checkpoint: none in %s; starting fresh", self.directory)
            return None
        first_error: BaseException | None = None
        for step in steps:
            try:
                if data_iterator is not None and first_error is not None:
                    data_iterator.set_state({"step": 0, "row": 0})  # a failed restore may have moved it
                restored = self.restore(step, abstract_train_state, data_iterator=data_iterator)
                if validate is not None:
                    validate(restored)
            except Exception as e:  # noqa: BLE001 - a damaged checkpoint: try the one before it
                first_error = first_error or e
                log.warning("checkpoint: step %d in %s cannot be used (%s: %s); trying an older one", step,
                            self.directory, type(e).__name__, str(e).splitlines()[0] if str(e) else "")
                continue
            if first_error is not None:
                print(f"rl: checkpoint(s) newer than step {step} could not be used ({type(first_error).__name__}: "
                      f"{str(first_error).splitlines()[0] if str(first_error) else ''}); resumed from step {step}",
                      flush=True)
            return restored
        if first_error is None:  # unreachable: each step above returned or set it
            raise RuntimeError(f"checkpoint: no step of {steps} in {self.directory} restored")
        raise first_error

    def restore(self, step: int, abstract_train_state, *, data_iterator=None) -> Restored:
        """Restore ``step`` onto the shardings of ``abstract_train_state`` (see ``abstract_like``).

        ``data_iterator``: a fresh grain iterator of the same pipeline; its
        position is restored in place. Required if the checkpoint has one (a
        silently ignored data position would replay or skip data).
        """
        target = abstract_like(abstract_train_state)
        _check_target(target)
        have = set(self._mngr.item_metadata(step).keys()) if hasattr(self._mngr, "item_metadata") else set(ITEMS)
        missing = {"state", "cursor", "buffer", "meta"} - have
        if missing:
            raise ValueError(f"checkpoint {self.directory}/{step} lacks items {sorted(missing)} (has {sorted(have)})")
        items = dict(
            state=ocp.args.StandardRestore(
                jax.tree.map(lambda x: np.empty(x.shape, x.dtype), target) if self._host_only else target),
            cursor=ocp.args.JsonRestore(),
            buffer=ocp.args.JsonRestore(),
            meta=ocp.args.JsonRestore(),
        )
        if "rng" in have:
            items["rng"] = ocp.args.JsonRestore()
        if "data" in have and data_iterator is None:
            raise ValueError(f"checkpoint {self.directory}/{step} holds a data iterator position; pass data_iterator=")
        if data_iterator is not None:
            if "data" not in have:
                raise ValueError(f"checkpoint {self.directory}/{step} has no data iterator state to restore")
            import grain

            items["data"] = grain.checkpoint.CheckpointRestore(data_iterator)
        out = self._mngr.restore(step, args=ocp.args.Composite(**items))
        meta = dict(out["meta"])
        if meta.get("format") != FORMAT or meta.get("format_version") != FORMAT_VERSION:
            raise ValueError(f"checkpoint {self.directory}/{step}: format {meta.get('format')!r} v{meta.get('format_version')}, expected {FORMAT!r} v{FORMAT_VERSION}")
        for k in ("format", "format_version", "step"):
            meta.pop(k)
        log.info("checkpoint: restored step %d from %s", step, self.directory)
        state = out["state"]
        if self._host_only:
            state = jax.tree.map(lambda a, t: jax.device_put(a, t.sharding), state, target)
        return Restored(
            step=int(step),
            train_state=state,
            rng=_rng_from_json(out["rng"]) if "rng" in out else None,
            store_cursor=dict(out["cursor"]),
            buffer=list(out["buffer"]["rollout_ids"]),
            meta=meta,
        )

    # ------------------------------------------------------------------ lifecycle
    def wait_until_finished(self) -> None:
        try:
            self._mngr.wait_until_finished()
        except Exception as e:  # an async save's failure surfaces here
            raise _as_storage_error(self.directory, e)  # noqa: B904 - its cause chain is set there

    def close(self) -> None:
        """Wait for a pending async save, then release the manager."""
        self.wait_until_finished()
        self._mngr.close()

    def __enter__(self) -> "Checkpointer":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def resume_store(store, restored: Restored) -> list[str]:
    """Rewind the store's cursor to the checkpoint's; return the rollouts to train next.

    Rollouts marked trained after the checkpoint become pending again (their
    updates were lost with the process). Returns the saved buffer in its order,
    then every other pending rollout (finished after the checkpoint) in arrival
    order. Raises if a buffered rollout is not pending in the store (the store
    does not belong to this checkpoint).
    """
    store.restore_cursor(restored.store_cursor)
    pending = store.pending_rollouts()
    pending_set = set(pending)
    gone = [r for r in restored.buffer if r not in pending_set]
    if gone:
        raise ValueError(
            f"resume_store: {len(gone)} buffered rollouts of checkpoint step {restored.step} are not pending in "
            f"{store.directory}: {gone[:5]} (wrong store, or records lost)"
        )
    buffered = set(restored.buffer)
    return list(restored.buffer) + [r for r in pending if r not in buffered]
