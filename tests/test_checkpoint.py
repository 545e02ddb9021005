"""Checkpointer: one atomic checkpoint of state/rng/data/cursor/buffer/meta, restored onto a new layout."""

import grain
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import Mesh, NamedSharding, SingleDeviceSharding
from jax.sharding import PartitionSpec as P

from gyre_jax.rl.checkpoint import CheckpointConfig, Checkpointer, abstract_like, resume_store
from gyre_jax.trajectory.records import ModelCallRecord, RolloutOutcome
from gyre_jax.trajectory.store import TrajectoryStore

TX = optax.adam(1e-2)


def make_state():
    rng = np.random.default_rng(0)
    params = {"w_DxF": jnp.asarray(rng.normal(size=(8, 6)), jnp.float32), "b_F": jnp.asarray(rng.normal(size=(6,)), jnp.float32)}
    opt_state = TX.init(params)
    # One real update so the moments are not zeros (a restore of zeros proves little).
    grads = jax.tree.map(lambda p: p * 0.5 + 1.0, params)
    updates, opt_state = TX.update(grads, opt_state, params)
    params = optax.apply_updates(params, updates)
    return {"step": jnp.int32(1), "policy_version": jnp.int32(7), "params": params, "opt_state": opt_state}


def layout(tree, mesh):
    """Shard 2-D leaves' first axis over 'x', replicate the rest (a stand-in for a cell's rules)."""
    def one(x):
        if x.ndim == 2 and x.shape[0] % mesh.shape["x"] == 0:
            return NamedSharding(mesh, P("x", None))
        return NamedSharding(mesh, P())

    return jax.tree.map(one, tree)


def mesh_of(devs):
    return Mesh(np.array(devs), ("x",))


def write_rollout(store, rid, *, n_prompt=3, n_out=2):
    run = store.run_id
    tok = np.arange(n_prompt, dtype=np.int32) + 1
    out = np.arange(n_out, dtype=np.int32) + 5
    store.append(ModelCallRecord(run_id=run, rollout_id=rid, task_id="t", group_id="g", agent_id=0, parent_agent_id=None,
                                 role="main", call_index=0, prompt_ids=tok, output_ids=out,
                                 output_logprobs=np.full(n_out, -0.5, np.float32), policy_version=0,
                                 t_start=1.0, t_end=2.0, finish_reason="stop"))
    store.append(RolloutOutcome(run_id=run, rollout_id=rid, task_id="t", group_id="g", status="completed", score=0.5,
                                t_end=2.0, num_calls=1))


def data_iter():
    return grain.MapDataset.source(list(range(20))).shuffle(seed=3).map(lambda x: x * 10).to_iter_dataset().__iter__()


def leaves_equal(a, b):
    la, lb = jax.tree.leaves(a), jax.tree.leaves(b)
    assert jax.tree.structure(a) == jax.tree.structure(b)
    for x, y in zip(la, lb):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """One checkpoint written from a 4-device layout; the tests restore it onto others."""
    root = tmp_path_factory.mktemp("ckpt")
    devs = jax.devices()
    state = make_state()
    state4 = jax.device_put(state, layout(state, mesh_of(devs[:4])))
    assert state4["params"]["w_DxF"].sharding.num_devices == 4
    store = TrajectoryStore(str(root / "store"), run_id="run0")
    for i in range(4):
        write_rollout(store, f"r{i}")
    store.mark_trained(["r0", "r1"], step=0)
    it = data_iter()
    seen = [next(it) for _ in range(5)]
    rng = jax.random.fold_in(jax.random.key(42, impl="rbg"), 3)  # a non-default impl must survive too
    ck = Checkpointer(CheckpointConfig(directory=str(root / "ckpt")))
    assert ck.save(1, train_state=state4, rng=rng, store_cursor=store.cursor_state(), buffer=["r3", "r2"],
                   data_iterator=it, meta={"rollouts_done": 4})
    rest_of_data = [next(it) for _ in range(5)]
    ck.close()
    return dict(root=root, state=state, rng=rng, store=store, seen=seen, rest=rest_of_data)


@pytest.mark.parametrize("ndev", [2, 1])
def test_restore_onto_other_layout(saved, ndev):
    devs = jax.devices()
    if ndev == 1:
        target_sh = jax.tree.map(lambda _: SingleDeviceSharding(devs[7]), saved["state"])
    else:
        target_sh = layout(saved["state"], mesh_of(devs[4:6]))  # devices the writer never used
    abstract = abstract_like(jax.eval_shape(lambda: saved["state"]), target_sh)
    ck = Checkpointer(CheckpointConfig(directory=str(saved["root"] / "ckpt")))
    it = data_iter()
    r = ck.restore_latest(abstract, data_iterator=it)
    ck.close()
    assert r.step == 1
    leaves_equal(r.train_state, saved["state"])
    for got, want in zip(jax.tree.leaves(r.train_state), jax.tree.leaves(target_sh)):
        assert got.sharding == want, (got.sharding, want)
    if ndev == 2:
        assert r.train_state["params"]["w_DxF"].sharding.spec == P("x", None)
    np.testing.assert_array_equal(jax.random.key_data(r.rng), jax.random.key_data(saved["rng"]))
    assert jax.random.key_impl(r.rng) == jax.random.key_impl(saved["rng"])
    assert [next(it) for _ in range(5)] == saved["rest"]  # grain position restored in place
    assert r.buffer == ["r3", "r2"]
    assert r.meta == {"rollouts_done": 4}
    assert set(r.store_cursor["consumed"]) == {"r0", "r1"}


def test_resume_store_rewinds_cursor(saved, tmp_path):
    """Marked-trained after the checkpoint -> pending again; finished after it -> pending; buffer first."""
    store = saved["store"]
    ck = Checkpointer(CheckpointConfig(directory=str(saved["root"] / "ckpt")))
    abstract = abstract_like(jax.eval_shape(lambda: saved["state"]), jax.tree.map(lambda _: SingleDeviceSharding(jax.devices()[0]), saved["state"]))
    r = ck.restore_latest(abstract, data_iterator=data_iter())
    ck.close()
    store.mark_trained(["r2"], step=1)  # after the checkpoint: its update is not in the saved params
    write_rollout(store, "r4")  # finished after the checkpoint
    assert set(store.consumed()) == {"r0", "r1", "r2"}
    order = resume_store(store, r)
    assert order == ["r3", "r2", "r4"]
    assert set(store.consumed()) == {"r0", "r1"}
    with TrajectoryStore(store.directory, writable=False) as disk:  # persisted, not only in memory
        assert set(disk.consumed()) == {"r0", "r1"}
    other = TrajectoryStore(str(tmp_path / "other"), run_id="run0")
    for i in range(2):
        write_rollout(other, f"r{i}")
    with pytest.raises(ValueError, match="does not match this log|not pending"):
        resume_store(other, r)
    other.close()


def test_keep_interval_force_and_fresh(tmp_path):
    ck = Checkpointer(CheckpointConfig(directory=str(tmp_path / "c"), max_to_keep=2, save_interval_steps=2))
    target = abstract_like({"a": jnp.zeros(3)})
    assert ck.restore_latest(target) is None
    cur = {"version": 1, "run_id": "x", "consumed": {}}
    saved = [ck.save(s, train_state={"a": jnp.full(3, s, jnp.float32)}, rng=jax.random.key(s), store_cursor=cur) for s in range(7)]
    assert saved == [True, False, True, False, True, False, True]
    assert ck.save(7, train_state={"a": jnp.full(3, 7.0)}, rng=jax.random.key(7), store_cursor=cur, force=True)
    assert ck.all_steps() == [6, 7]
    r = ck.restore_latest(target)
    assert r.step == 7 and float(r.train_state["a"][0]) == 7.0
    r6 = ck.restore(6, target)
    assert float(r6.train_state["a"][0]) == 6.0
    ck.close()


def test_raw_uint32_key_roundtrip(tmp_path):
    ck = Checkpointer(CheckpointConfig(directory=str(tmp_path / "c")))
    raw = jax.random.PRNGKey(5)
    ck.save(0, train_state={"a": jnp.ones(2)}, rng=raw, store_cursor={"consumed": {}})
    r = ck.restore_latest(abstract_like({"a": jnp.ones(2)}))
    assert r.rng.dtype == raw.dtype
    np.testing.assert_array_equal(np.asarray(r.rng), np.asarray(raw))
    ck.close()


def test_bad_input_is_named(tmp_path):
    ck = Checkpointer(CheckpointConfig(directory=str(tmp_path / "c")))
    cur = {"consumed": {"r1": {}}}
    st = {"a": jnp.ones(2)}
    with pytest.raises(ValueError, match="both buffered and consumed.*r1"):
        ck.save(0, train_state=st, rng=jax.random.key(0), store_cursor=cur, buffer=["r1"])
    with pytest.raises(ValueError, match="listed twice"):
        ck.save(0, train_state=st, rng=jax.random.key(0), store_cursor=cur, buffer=["r2", "r2"])
    with pytest.raises(ValueError, match="reserved"):
        ck.save(0, train_state=st, rng=jax.random.key(0), store_cursor=cur, meta={"step": 3})
    with pytest.raises(ValueError, match="step must be"):
        ck.save(-1, train_state=st, rng=jax.random.key(0), store_cursor=cur)
    it = data_iter()
    ck.save(0, train_state=st, rng=jax.random.key(0), store_cursor=cur, data_iterator=it)
    no_sharding = {"a": jax.ShapeDtypeStruct((2,), jnp.float32)}
    with pytest.raises(ValueError, match=r"without a sharding: \[\"\['a'\]\"\]"):
        ck.restore_latest(no_sharding, data_iterator=data_iter())
    with pytest.raises(ValueError, match="data iterator position; pass data_iterator"):
        ck.restore_latest(abstract_like(st))
    ck.close()
    with pytest.raises(ValueError, match="max_to_keep must be >= 2 with async_save"):
        CheckpointConfig(directory="x", max_to_keep=1, async_save=True)
    with pytest.raises(ValueError, match="save_interval_steps"):
        CheckpointConfig(directory="x", save_interval_steps=0)


def test_bad_rng_is_named(tmp_path):
    ck = Checkpointer(CheckpointConfig(directory=str(tmp_path / "c")))
    with pytest.raises(ValueError, match="rng must be a JAX PRNG key"):
        ck.save(0, train_state={"a": jnp.ones(2)}, rng=jnp.ones(2), store_cursor={"consumed": {}})
    ck.close()


def test_a_clean_restore_logs_no_warning(saved, caplog):
    """Every item has its handler: Orbax has nothing to warn about ("could not be restored")."""
    import logging

    abstract = abstract_like(jax.eval_shape(lambda: saved["state"]),
                             jax.tree.map(lambda _: SingleDeviceSharding(jax.devices()[0]), saved["state"]))
    with caplog.at_level(logging.WARNING):
        with Checkpointer(CheckpointConfig(directory=str(saved["root"] / "ckpt"))) as ck:
            r = ck.restore_latest(abstract, data_iterator=data_iter())
    assert r.step == 1
    assert [rec.getMessage() for rec in caplog.records if rec.levelno >= logging.WARNING] == []


def test_the_rng_item_is_optional(tmp_path):
    state = {"w": jnp.arange(3.0)}
    with Checkpointer(CheckpointConfig(directory=str(tmp_path / "c"))) as ck:
        ck.save(2, train_state=state, store_cursor={"consumed": {}}, force=True)
    with Checkpointer(CheckpointConfig(directory=str(tmp_path / "c"))) as ck:
        r = ck.restore_latest(abstract_like(jax.eval_shape(lambda: state),
                                            {"w": SingleDeviceSharding(jax.devices()[0])}))
    assert r.step == 2 and r.rng is None
    np.testing.assert_array_equal(r.train_state["w"], state["w"])


def test_a_full_disk_under_a_save_is_a_storage_error_naming_the_directory(tmp_path):
    """A checkpoint save on a full disk is our storage failing (exit 3, the path), not a failed run (exit 1).
    Real ENOSPC where the machine can mount a small tmpfs; the Orbax/tensorstore message form in any case."""
    import errno
    import subprocess

    from gyre_jax.errors import StorageError
    from gyre_jax.rl.checkpoint import _as_storage_error

    # What Orbax raised on a full tmpfs in tools/bench_chaos.py --disk-full (tensorstore's text, a ValueError).
    ts = ValueError('RESOURCE_EXHAUSTED: Error writing "opt_state.1.0.count/0" in OCDBT database at local file '
                    '"/w/checkpoints/6.orbax-checkpoint-tmp/": Failed to write 38559 bytes to file 234: No space '
                    "left on device [os_error_code='28']")
    wrapped = RuntimeError("commit failed")
    wrapped.__cause__ = OSError(errno.EIO, "Input/output error")
    for e in (ts, OSError(errno.EROFS, "Read-only file system"), wrapped):
        got = _as_storage_error("/w/checkpoints", e)
        assert isinstance(got, StorageError) and got.path == "/w/checkpoints", (e, got)
    err = _as_storage_error("/w/checkpoints", ts)
    assert str(err) == "storage failed: writing a checkpoint in /w/checkpoints: No space left on device"
    # The loop re-raises StorageError(path, what, cause) for its error: line: the cause must read as short.
    assert str(StorageError(err.path, err.what, err.__cause__)) == str(err) and err.__cause__.__cause__ is ts
    bad = ValueError("shape mismatch")  # not our disk: left as it is
    assert _as_storage_error("/w/checkpoints", bad) is bad

    small = tmp_path / "small"
    small.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(small)], capture_output=True).returncode:
        pytest.skip("cannot mount a small tmpfs here (needs root): the real full disk is left to tools/bench_chaos.py")
    try:
        ck = Checkpointer(CheckpointConfig(directory=str(small / "ckpt")))
        big = {"step": jnp.int32(1), "policy_version": jnp.int32(1), "params": {"w": jnp.ones((256, 256), jnp.float32)}}
        store = TrajectoryStore(str(tmp_path / "store"), run_id="r")
        with pytest.raises(StorageError, match="storage failed: writing a checkpoint in .*small/ckpt: No space left"):
            ck.save(1, train_state=big, store_cursor=store.cursor_state(), force=True)
        store.close()
        ck._mngr.close()
    finally:
        subprocess.run(["umount", str(small)], check=False)
