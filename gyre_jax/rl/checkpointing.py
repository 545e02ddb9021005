"""The RL run's checkpoints: what one holds, when one is saved, and the save after a failure.

A checkpoint (``rl.checkpoint.Checkpointer``, one atomic Orbax step) holds the train state, the
grain iterator's position, the store's cursor and the finished-but-untrained rollouts (the
trainer's ``TrainerSnapshot``), labelled with the state's own policy version. ``CheckpointHook``
saves one after every ``checkpoint_every``-th update and after the last, on the trainer's thread
(an update hook: ``gyre_jax.rl.hooks``); ``save_after_failure`` keeps what a failing run trained.
"""
from __future__ import annotations

import logging
import os

import jax

from gyre_jax.rl.checkpoint import CheckpointConfig, Checkpointer
from gyre_jax.rl.hooks import UpdateInfo
from gyre_jax.rl.step_events import TrainerSnapshot

log = logging.getLogger(__name__)


def open_checkpointer(workdir: str, *, every: int, steps: int, this_process_only: bool) -> Checkpointer:
    """``<workdir>/checkpoints``: a save every ``every`` steps (0: only at the end), the newest two kept."""
    return Checkpointer(CheckpointConfig(directory=os.path.join(workdir, "checkpoints"), max_to_keep=2,
                                         save_interval_steps=every or steps, this_process_only=this_process_only))


def check_checkpoint(restored, iterator, frozen=None) -> None:
    """A checkpoint's label is its state's policy version and its data position's step, and a LoRA run's
    adapters were trained on this base (``frozen``; ValueError if not)."""
    if frozen is not None:
        from gyre_jax.rl import lora_run

        lora_run.check_resume(restored.meta, frozen)
    version = int(jax.device_get(restored.train_state.policy_version))
    if version != restored.step:
        raise ValueError(f"checkpoint step {restored.step} holds policy version {version}")
    if iterator.get_state()["step"] != restored.step:
        raise ValueError(f"checkpoint step {restored.step} holds data position {iterator.get_state()}")


def save_checkpoint(ckpt: Checkpointer, snap: TrainerSnapshot, store, mode: str, version: int, *,
                    force: bool, frozen=None) -> None:
    """State, data position, store cursor and the finished-but-untrained rollouts, as one checkpoint.

    Its label ``version`` must be the state's own policy version (a checkpoint whose label lies
    cannot be resumed: the loop refuses it at load)."""
    state_version = int(jax.device_get(snap.state.policy_version))
    if state_version != version:
        raise RuntimeError(f"save_checkpoint: label {version} but the state is at policy version {state_version}")
    meta = {"mode": mode}
    if frozen is not None:  # a LoRA run's adapters: the base they were trained on (rl/lora_run.py)
        from gyre_jax.rl import lora_run

        meta[lora_run.META_KEY] = frozen.fingerprint()
    ckpt.save(version, train_state=snap.state, store_cursor=store.cursor_state(),
              buffer=list(snap.buffered_rollouts), data_iterator=snap.data_iterator, meta=meta, force=force)


class CheckpointHook:
    """The run's checkpoints: ``on_update`` is the update hook, ``save_after_failure`` the failure path's."""

    def __init__(self, ckpt: Checkpointer, store, mode: str, frozen=None):
        self.ckpt, self.store, self.mode, self.frozen = ckpt, store, mode, frozen

    def on_update(self, info: UpdateInfo) -> None:
        save_checkpoint(self.ckpt, info.snapshot, self.store, self.mode, info.version, force=info.last,
                        frozen=self.frozen)

    def save_after_failure(self, trainer) -> None:
        """A checkpoint of the trained state if the last one is older (the store is durable: every finished
        rollout is pending again at resume, so only the order is saved here). ``trainer``: the loop's
        TrainerAdapter; its open step is abandoned first (its rollouts stay buffered)."""
        if not trainer.abandon_step():
            log.warning("rl: not saving after the failure: the trainer did not stop; the rerun resumes from the "
                        "last checkpoint")
            return
        # The state's own version, and only where the store's cursor already marks that update's rollouts
        # trained (a failure between the update and mark_trained leaves the cursor behind: no save then).
        snap = trainer.snapshot()
        state_version = int(jax.device_get(snap.state.policy_version))
        version = trainer.cursor_version()
        if version != state_version:
            log.warning("rl: not saving after the failure: the state is at version %d, the store's cursor at %d; "
                        "the rerun resumes from the last checkpoint", state_version, version)
            return
        last = self.ckpt.latest_step()
        if version > 0 and (last is None or last < version):
            # The abandoned step may have read some of its rows: the saved position is the step's
            # start, whose rows the resumed run rebuilds from the buffered rollouts.
            snap.data_iterator.set_state({"step": version, "row": 0})
            save_checkpoint(self.ckpt, snap, self.store, self.mode, version, force=True, frozen=self.frozen)
            print(f"rl: saved checkpoint step {version} after the failure", flush=True)
