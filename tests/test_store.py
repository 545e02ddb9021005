"""Trajectory store: durable framed log, quarantine, readers while writing, cursor, kill -9."""
import json
import os
import signal
import subprocess
import sys
import textwrap
import threading

import numpy as np
import pytest

from gyre_jax.trajectory.records import ModelCallRecord, RecordError, RolloutOutcome
from gyre_jax.trajectory.store import LOG_NAME, StoreConfig, TrajectoryStore

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def call(rid, ci, *, n_prompt=6, n_out=3, seed=None, **over):
    rng = np.random.default_rng(seed if seed is not None else hash((rid, ci)) % 2**32)
    kw = dict(run_id="run", rollout_id=rid, task_id="t-" + rid[:1], group_id="g", agent_id=0, parent_agent_id=None,
              role="main", call_index=ci, prompt_ids=rng.integers(0, 1000, n_prompt), output_ids=rng.integers(0, 1000, n_out),
              output_logprobs=-rng.random(n_out), policy_version=0, t_start=1.0, t_end=2.0, finish_reason="stop")
    kw.update(over)
    return ModelCallRecord(**kw)


def outcome(rid, status="completed", score=0.5, **over):
    kw = dict(run_id="run", rollout_id=rid, task_id="t-" + rid[:1], group_id="g", status=status, score=score)
    kw.update(over)
    return RolloutOutcome(**kw)


def same(a, b):
    return a.to_bytes() == b.to_bytes()


def flip(path, off):
    with open(path, "r+b") as f:
        f.seek(off)
        b = f.read(1)
        f.seek(off)
        f.write(bytes([b[0] ^ 0xFF]))


def test_append_read_reopen(tmp_path):
    d = str(tmp_path / "s")
    recs = [call("a", 0), call("b", 0), call("a", 1), outcome("a", num_calls=2), call("b", 1)]
    with TrajectoryStore(d, run_id="run", config=StoreConfig(fsync="always")) as st:
        offs = [st.append(r) for r in recs]
        assert offs == sorted(offs) and offs[0] == 0
        assert st.pending_rollouts() == ["a"]
    st = TrajectoryStore(d)  # reopen: run id from meta.json
    assert st.run_id == "run"
    got = st.calls("a")
    assert [c.call_index for c in got] == [0, 1] and same(got[0], recs[0]) and same(got[1], recs[2])
    assert same(st.outcome("a"), recs[3]) and st.outcome("b") is None
    s = st.stats()
    assert (s.calls, s.outcomes, s.rollouts, s.complete, s.pending, s.quarantined) == (4, 1, 2, 1, 1, 0)
    assert s.torn_tails == () and s.corrupt_regions == () and s.conflicts == ()
    with pytest.raises(KeyError, match="'zz'"):
        st.calls("zz")
    st.close()
    with pytest.raises(ValueError, match="belongs to run 'run'"):
        TrajectoryStore(d, run_id="other")


def test_incomplete_until_all_calls_arrive(tmp_path):
    with TrajectoryStore(str(tmp_path), run_id="run") as st:
        st.append(call("a", 0))
        st.append(outcome("a", num_calls=2))
        assert st.pending_rollouts() == [] and st.stats().incomplete == 1


def test_quarantine_keeps_good_neighbours(tmp_path):
    d = str(tmp_path)
    st = TrajectoryStore(d, run_id="run")
    good1 = call("a", 0)
    st.append(good1)
    bad_dict = {**good1.to_dict(), "call_index": 1, "output_logprobs": [-0.1, 0.5, -0.2]}
    bad_cases = [
        (bad_dict, "output_logprobs"),
        (call("a", 0, seed=99), "call_index"),  # different call, same index
        (call("x", 0, run_id="other-run"), "run_id"),
        (call("a", 2, task_id="t-z"), "task_id"),
        ('{"kind": "call"', "json"),
    ]
    for raw, field in bad_cases:
        with pytest.raises(RecordError) as ei:
            st.append(raw)
        assert ei.value.field == field
    good2 = call("a", 1)
    st.append(good2)
    st.append(outcome("a"))
    for raw, field in [(outcome("a", score=0.9), "rollout_id"), (call("a", 5), "rollout_id")]:
        with pytest.raises(RecordError, match="already recorded") as ei:
            st.append(raw)
    # An exact re-send is a counted duplicate, not an error and not a second frame.
    size = os.path.getsize(os.path.join(d, LOG_NAME))
    assert st.append(good1) == 0 and os.path.getsize(os.path.join(d, LOG_NAME)) == size
    s = st.stats()
    assert s.quarantined == 7 and s.duplicates == 1 and s.calls == 2 and s.outcomes == 1
    q = st.quarantined()
    assert "output_logprobs" in q[0]["error"] and "index 1 must be finite and <= 0" in q[0]["error"]
    assert q[0]["record"]["call_index"] == 1  # the raw record is kept for inspection / re-ingest
    assert q[2]["field"] == "run_id" and "other-run" in q[2]["error"]
    st.close()
    st = TrajectoryStore(d)
    assert [c.call_index for c in st.calls("a")] == [0, 1] and same(st.calls("a")[1], good2)
    assert st.stats().quarantined == 7


def test_vocab_check(tmp_path):
    with TrajectoryStore(str(tmp_path), run_id="run", config=StoreConfig(vocab_size=100)) as st:
        with pytest.raises(RecordError, match=r"prompt_ids: token id \d+ at index \d+ >= vocab_size 100"):
            st.append(call("a", 0))
        assert st.stats().quarantined == 1


def test_config_validation():
    with pytest.raises(ValueError, match="fsync='sometimes'"):
        StoreConfig(fsync="sometimes")


def test_single_writer(tmp_path):
    st = TrajectoryStore(str(tmp_path), run_id="run")
    with pytest.raises(RuntimeError, match="writer lock"):
        TrajectoryStore(str(tmp_path), run_id="run")
    st.close()
    TrajectoryStore(str(tmp_path)).close()


def test_reader_sees_complete_frames_only(tmp_path):
    d = str(tmp_path)
    w = TrajectoryStore(d, run_id="run")
    w.append(call("a", 0))
    r = TrajectoryStore(d, writable=False)
    assert r.stats().calls == 1
    # A frame in the middle of being written: the reader must not index it.
    c1 = call("a", 1, n_prompt=5000)
    from gyre_jax.trajectory.store import _frame

    frame = _frame(c1.to_bytes())
    with open(os.path.join(d, LOG_NAME), "ab") as f:
        f.write(frame[: len(frame) // 2])
    assert r.refresh() == 0 and r.stats().calls == 1 and r.stats().tail_pending_bytes == len(frame) // 2
    with open(os.path.join(d, LOG_NAME), "ab") as f:
        f.write(frame[len(frame) // 2 :])
    assert r.refresh() == 1 and same(r.calls("a")[1], c1) and r.stats().tail_pending_bytes == 0
    with pytest.raises(RuntimeError, match="read-only"):
        r.append(call("a", 2))
    r.close()
    w.close()


def test_torn_tail_truncated_and_appends_continue(tmp_path):
    d = str(tmp_path)
    with TrajectoryStore(d, run_id="run") as st:
        st.append(call("a", 0))
        st.append(call("a", 1))
        good_end = os.path.getsize(os.path.join(d, LOG_NAME))
    from gyre_jax.trajectory.store import _frame

    torn = _frame(call("a", 2).to_bytes())[:37]
    with open(os.path.join(d, LOG_NAME), "ab") as f:
        f.write(torn)
    st = TrajectoryStore(d)
    s = st.stats()
    assert s.calls == 2 and len(s.torn_tails) == 1
    off, n, saved = s.torn_tails[0]
    assert (off, n) == (good_end, 37)
    with open(saved, "rb") as f:
        assert f.read() == torn
    st.append(call("a", 2))
    st.close()
    st = TrajectoryStore(d)
    assert [c.call_index for c in st.calls("a")] == [0, 1, 2] and len(st.stats().torn_tails) == 1
    st.close()


def test_mid_log_damage_skipped_not_truncated(tmp_path):
    d = str(tmp_path)
    with TrajectoryStore(d, run_id="run") as st:
        o = [st.append(call("a", i)) for i in range(3)]
    path = os.path.join(d, LOG_NAME)
    flip(path, o[1] + 40)  # a payload byte of the middle frame
    size = os.path.getsize(path)
    st = TrajectoryStore(d)
    s = st.stats()
    assert [c.call_index for c in st.calls("a")] == [0, 2]
    assert s.corrupt_regions == ((o[1], o[2] - o[1]),) and s.torn_tails == ()
    assert os.path.getsize(path) == size  # good data after the damage is never truncated
    st.close()


def test_cursor_resume_and_restore(tmp_path):
    d = str(tmp_path)
    st = TrajectoryStore(d, run_id="run")
    for rid in "abcd":
        st.append(call(rid, 0))
    st.append(outcome("b"))
    st.append(outcome("a"))
    st.append(outcome("c", status="infra_error", score=None))
    assert st.pending_rollouts() == ["b", "a", "c"]
    st.mark_trained(["b"], step=1)
    ckpt = st.cursor_state()
    st.mark_dropped(["c"], step=2, reason="infra_error")
    st.mark_trained(["a"], step=2)
    with pytest.raises(ValueError, match="already consumed"):
        st.mark_trained(["a"], step=3)
    with pytest.raises(ValueError, match="'d': it is not complete"):
        st.mark_trained(["d"], step=3)
    with pytest.raises(ValueError, match="non-empty reason"):
        st.mark_dropped(["d"], step=3, reason="")
    st.close()
    st = TrajectoryStore(d)  # cursor persisted
    s = st.stats()
    assert st.pending_rollouts() == [] and (s.trained, s.dropped) == (2, 1)
    assert st.consumed()["c"]["reason"] == "infra_error"
    st.restore_cursor(ckpt)  # resume from the step-1 checkpoint: a and c are pending again
    assert st.pending_rollouts() == ["a", "c"]
    st.close()
    st = TrajectoryStore(d, writable=False)
    assert st.pending_rollouts() == ["a", "c"]
    bad = dict(ckpt, consumed={"b": dict(ckpt["consumed"]["b"], outcome_offset=1)})
    with pytest.raises(ValueError, match="does not match this log"):
        st.restore_cursor(bad)
    st.close()
    assert not [f for f in os.listdir(d) if ".tmp." in f]


WRITER = textwrap.dedent("""
    import sys, numpy as np
    from gyre_jax.trajectory.records import ModelCallRecord
    from gyre_jax.trajectory.store import StoreConfig, TrajectoryStore
    st = TrajectoryStore(sys.argv[1], run_id="run", config=StoreConfig(fsync="never"))
    rng = np.random.default_rng(len(sys.argv[1]))
    n0 = st.stats().calls
    i = 0
    while True:
        n = int(rng.integers(500_000, 2_000_000))  # big frames: the writev takes milliseconds
        st.append(ModelCallRecord(run_id="run", rollout_id="r", task_id="t", group_id="g", agent_id=0,
            parent_agent_id=None, role="main", call_index=n0 + i, prompt_ids=np.full(n, n0 + i, np.int32),
            output_ids=[1], output_logprobs=[-1.0], policy_version=0, t_start=0.0, t_end=0.0, finish_reason="stop"))
        i += 1
        print(n0 + i, st.stats().log_bytes, flush=True)  # acknowledged: count, log end
""")


def test_kill_9_mid_append(tmp_path):
    """A real writer process gets SIGKILL while appending; every acknowledged record survives.

    The parent watches the log grow past the last acknowledged end (a write in
    progress) and kills right then, so most kills land inside the writev.
    """
    d = str(tmp_path / "s")
    log_path = os.path.join(d, LOG_NAME)
    env = dict(os.environ, PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))
    torn = 0
    for attempt in range(10):
        p = subprocess.Popen([sys.executable, "-c", WRITER, d], stdout=subprocess.PIPE, env=env, text=True)
        acks = []
        reader = threading.Thread(target=lambda: [acks.append(tuple(map(int, l.split()))) for l in p.stdout])
        reader.start()
        while len(acks) < 2:  # let it append a couple of records first
            assert p.poll() is None, "writer died"
        while os.stat(log_path).st_size <= acks[-1][1]:
            assert p.poll() is None, "writer died"
        os.kill(p.pid, signal.SIGKILL)
        p.wait()
        reader.join()
        acked = acks[-1][0]
        st = TrajectoryStore(d)
        s = st.stats()
        assert s.corrupt_regions == () and s.conflicts == ()
        assert acked <= s.calls <= acked + 1  # acknowledged appends survive; at most the one in flight
        calls = st.calls("r")
        assert [c.call_index for c in calls] == list(range(s.calls))
        assert all((c.prompt_ids == c.call_index).all() for c in calls)  # every record intact
        torn = len(s.torn_tails)
        st.close()
        print(f"attempt {attempt}: acked {acked}, stored {s.calls}, torn tails so far {torn}")
        if torn >= 1 and attempt >= 1:  # a torn tail was recovered, and a writer appended after a crash
            break
    assert torn >= 1, "no kill landed inside a write in 10 tries; the torn-tail path was not exercised"


def test_damage_report_mid_log(tmp_path):
    """Lost outcome / lost call / a rollout known only from damage, each named, with its byte range."""
    d = str(tmp_path)
    recs = [call("d", 0), outcome("d", num_calls=1), call("a", 0), call("e", 0), call("e", 1), call("a", 1),
            outcome("a"), call("z", 0), call("b", 0), outcome("e", num_calls=2), call("c", 0)]
    with TrajectoryStore(d, run_id="run") as st:
        o = [st.append(r) for r in recs] + [None]
        assert st.damaged_rollouts() == {} and st.unfinished_rollouts() == ["z", "b", "c"]
    o[-1] = os.path.getsize(os.path.join(d, LOG_NAME))
    path = os.path.join(d, LOG_NAME)
    flip(path, o[5] - 1)  # e's call 1: a token byte (its header stays readable)
    flip(path, o[6] + 16)  # a's outcome: the '{' of its JSON header (unreadable)
    flip(path, o[8] - 1)  # z's only call, next to it: one damaged region of two frames
    st = TrajectoryStore(d)
    r1, r2 = (o[4], o[5] - o[4], LOG_NAME), (o[6], o[8] - o[6], LOG_NAME)
    assert st.stats().corrupt_regions == (r1[:2], r2[:2])
    rep = st.damaged_rollouts()
    assert list(rep) == ["a", "e", "z"]
    # a: no outcome, unreadable damage after its last call: its outcome may have been there.
    assert (rep["a"].reason, rep["a"].calls, rep["a"].regions) == ("outcome_maybe_damaged", 2, (r2,))
    # e: its outcome says 2 calls, one survived: certain loss; r1 names the call, r2 is unaccounted.
    assert (rep["e"].reason, rep["e"].calls, rep["e"].regions) == ("calls_missing", 1, (r1, r2))
    # z: every record damaged, named from the damaged header.
    assert (rep["z"].reason, rep["z"].calls, rep["z"].regions) == ("call_damaged", 0, (r2,))
    # b and c wrote after the damage: unfinished (running, or cut off), not damaged. d is complete.
    assert st.unfinished_rollouts() == ["a", "b", "c"] and st.pending_rollouts() == ["d"]
    s = st.stats()
    assert (s.unfinished, s.damaged_rollouts, s.complete, s.incomplete) == (3, 3, 1, 1)
    st.close()


def test_damage_report_named_outcome(tmp_path):
    d = str(tmp_path)
    with TrajectoryStore(d, run_id="run") as st:
        st.append(call("a", 0))
        off = st.append(outcome("a"))
        st.append(call("b", 0))
    flip(os.path.join(d, LOG_NAME), off + 8)  # the stored CRC: header intact, frame rejected
    with TrajectoryStore(d, writable=False) as st:
        rep = st.damaged_rollouts()
        assert list(rep) == ["a"] and rep["a"].reason == "outcome_damaged" and rep["a"].regions[0][0] == off
        assert st.unfinished_rollouts() == ["a", "b"] and st.outcome("a") is None


def test_damage_report_torn_tails(tmp_path):
    """Torn tails: an unreadable one may hold any earlier unfinished rollout's outcome; a readable one names its rollout."""
    from gyre_jax.trajectory.store import _frame

    d = str(tmp_path)
    path = os.path.join(d, LOG_NAME)

    def tear(rec, n):
        with open(path, "ab") as f:
            f.write(_frame(rec.to_bytes())[:n])

    with TrajectoryStore(d, run_id="run") as st:
        for r in (call("a", 0), call("b", 0), call("b", 1)):
            st.append(r)
    tear(outcome("a"), 14)  # cut inside the frame header
    with TrajectoryStore(d) as st:
        (t1,) = st.torn_tails()
        rep = st.damaged_rollouts()
        assert {k: (v.reason, v.regions) for k, v in rep.items()} == {
            "a": ("outcome_maybe_damaged", (t1,)), "b": ("outcome_maybe_damaged", (t1,))}
        st.append(call("c", 0))  # appended after recovery, at the torn tail's offset
        st.append(call("b", 2))  # b wrote again after the crash: its outcome was not in t1
    tear(call("c", 1, n_prompt=5000), 300)  # cut in the tokens: header readable
    with TrajectoryStore(d) as st:
        _, t2 = st.torn_tails()
        rep = st.damaged_rollouts()
        assert {k: (v.reason, v.regions) for k, v in rep.items()} == {
            "a": ("outcome_maybe_damaged", (t1,)), "c": ("call_damaged", (t2,))}
    tear(outcome("c"), 10)  # a second tear at the same offset keeps both saved tails
    with TrajectoryStore(d) as st:
        _, t2b, t3 = st.torn_tails()
        assert t2b == t2 and t3[0] == t2[0] and t3[2] != t2[2] and os.path.exists(t2[2]) and os.path.exists(t3[2])
        rep = st.damaged_rollouts()
        assert {k: (v.reason, v.regions) for k, v in rep.items()} == {
            "a": ("outcome_maybe_damaged", (t1, t3)), "b": ("outcome_maybe_damaged", (t3,)),
            "c": ("call_damaged", (t2, t3))}
        assert st.unfinished_rollouts() == ["a", "b", "c"] and st.stats().damaged_rollouts == 3


def test_a_full_disk_is_a_storage_error_at_every_write_site_and_nothing_half_written(tmp_path, monkeypatch):
    """ENOSPC (a real one, from /dev/full) on the log, the cursor and the quarantine: a StorageError naming
    the file; the index, the log and the cursor stay what they were, and appends work again once there is room."""
    from gyre_jax.errors import StorageError
    from gyre_jax.trajectory import cursor as cursor_mod
    from gyre_jax.trajectory import store as store_mod

    s = TrajectoryStore(str(tmp_path / "s"), run_id="run")
    s.append(call("a", 0))
    s.append(outcome("a"))
    size = os.path.getsize(tmp_path / "s" / LOG_NAME)
    healthy, s._wfd = s._wfd, os.open("/dev/full", os.O_WRONLY)
    with pytest.raises(StorageError, match="No space left on device") as e:
        s.append(call("b", 0))
    assert str(tmp_path / "s" / LOG_NAME) in str(e.value)
    assert os.path.getsize(tmp_path / "s" / LOG_NAME) == size and s.rollout_ids() == ["a"]
    os.close(s._wfd)
    s._wfd = healthy
    s.append(call("b", 0))  # room again: the same record goes in
    assert sorted(s.rollout_ids()) == ["a", "b"]

    def full(path, obj):
        raise OSError(28, "No space left on device")

    def half_then_full(fd, line, offset):  # the disk fills mid-line: part of it reaches the file
        os.pwrite(fd, line[: len(line) // 2], offset)
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(TrajectoryStore, "journal_write", staticmethod(half_then_full))
    with pytest.raises(StorageError, match="cursor.jsonl"):
        s.mark_trained(["a"], step=0)
    assert s.consumed() == {}  # memory says what the disk says
    assert os.path.getsize(tmp_path / "s" / "cursor.jsonl") == 0  # the half line was cut back
    monkeypatch.undo()
    monkeypatch.setattr(cursor_mod, "_atomic_write_json", full)
    with pytest.raises(StorageError, match="cursor.json"):
        s.restore_cursor(s.cursor_state())
    monkeypatch.setattr(store_mod, "_append_line", full)
    with pytest.raises(StorageError, match="quarantin"):
        s.append({"kind": "bogus"})
    monkeypatch.undo()
    s.mark_trained(["a"], step=0)
    assert s.consumed()["a"]["state"] == "trained"
    s.close()


def _store_with_outcomes(d, n):
    st = TrajectoryStore(d, run_id="run")
    for i in range(n):
        st.append(call(f"r{i}", 0, n_prompt=2, n_out=1))
        st.append(outcome(f"r{i}"))
    return st


def test_cursor_is_an_append_only_journal_with_compaction(tmp_path, monkeypatch):
    """One short line per consumed step, not a rewrite of the whole cursor (O(steps^2) bytes over a run);
    compaction into the snapshot keeps the bytes written linear, and every reopen reads the same cursor."""
    from gyre_jax.trajectory import cursor as store_mod

    d = str(tmp_path)
    st = _store_with_outcomes(d, 40)
    for i in range(10):
        st.mark_trained([f"r{i}"], step=i)
    assert not os.path.exists(os.path.join(d, "cursor.json"))  # nothing rewritten yet: ten appends
    with open(os.path.join(d, "cursor.jsonl")) as f:
        assert len(f.readlines()) == 10
    monkeypatch.setattr(store_mod, "CURSOR_COMPACT_MIN_BYTES", 400)
    sizes = []
    for i in range(10, 40):
        (st.mark_dropped if i % 3 == 0 else st.mark_trained)([f"r{i}"], step=i, **({"reason": "x"} if i % 3 == 0 else {}))
        sizes.append(os.path.getsize(os.path.join(d, "cursor.jsonl")))
        with TrajectoryStore(d, writable=False) as disk:
            assert disk.consumed() == st.consumed()
    assert os.path.exists(os.path.join(d, "cursor.json")) and min(sizes) < 100 < max(sizes)  # compacted, then grew again
    st.close()
    st = TrajectoryStore(d)
    assert len(st.consumed()) == 40 and st.consumed()["r12"]["reason"] == "x" and st.pending_rollouts() == []
    st.close()


def test_cursor_journal_torn_tail_damage_and_stale_epochs(tmp_path, monkeypatch):
    d = str(tmp_path)
    jpath = os.path.join(d, "cursor.jsonl")
    st = _store_with_outcomes(d, 4)
    st.mark_trained(["r0"], step=0)
    st.mark_trained(["r1"], step=1)
    st.close()
    with open(jpath, "ab") as f:  # a kill -9 mid-line: no newline
        f.write(b'{"epoch":0,"state":"trained","step":2,"reason":null,"rollo')
    st = TrajectoryStore(d)
    assert sorted(st.consumed()) == ["r0", "r1"]  # the torn line is ignored...
    st.mark_trained(["r2"], step=2)  # ...and cut off by the next write
    st.close()
    with open(jpath) as f:
        assert [json.loads(x)["step"] for x in f] == [0, 1, 2]
    # A snapshot written, then the journal could not be emptied (a crash in between): its lines are stale
    # and must not come back, even for rollouts the restored snapshot un-consumed.
    st = TrajectoryStore(d)
    ckpt = st.cursor_state()
    st.mark_trained(["r3"], step=3)
    from gyre_jax.trajectory.cursor import Cursor
    monkeypatch.setattr(Cursor, "_truncate_journal", lambda self, n: (_ for _ in ()).throw(OSError(5, "EIO")))
    st.restore_cursor(dict(ckpt, consumed={k: v for k, v in ckpt["consumed"].items() if k == "r0"}))
    monkeypatch.undo()
    st.mark_trained(["r2"], step=2)
    st.close()
    with TrajectoryStore(d, writable=False) as disk:
        assert sorted(disk.consumed()) == ["r0", "r2"] and disk.pending_rollouts() == ["r1", "r3"]
    with open(jpath, "rb") as f:
        lines = f.read().split(b"\n")
    with open(jpath, "wb") as f:  # damage in the middle, good lines after it: refused, naming file and line
        f.write(b"\n".join([lines[0], b"x" * 10, *lines[1:]]))
    with pytest.raises(ValueError, match=r"cursor.jsonl is damaged at line 2"):
        TrajectoryStore(d, writable=False)


def test_a_cursor_json_from_before_the_journal_still_resumes(tmp_path):
    d = str(tmp_path)
    st = _store_with_outcomes(d, 3)
    offs = {r: st._rollouts[r].outcome[0] for r in ("r0", "r1", "r2")}
    st.close()
    old = {"version": 1, "run_id": "run", "log_offset": 0,
           "consumed": {"r0": {"state": "trained", "step": 0, "reason": None, "outcome_offset": offs["r0"]}}}
    with open(os.path.join(d, "cursor.json"), "w") as f:
        json.dump(old, f)
    st = TrajectoryStore(d)
    assert sorted(st.consumed()) == ["r0"] and st.pending_rollouts() == ["r1", "r2"]
    st.mark_trained(["r1"], step=1)
    st.close()
    with TrajectoryStore(d, writable=False) as disk:
        assert sorted(disk.consumed()) == ["r0", "r1"]


MARKER = textwrap.dedent("""
    import sys
    from gyre_jax.trajectory import cursor as store_mod
    from gyre_jax.trajectory.store import TrajectoryStore
    store_mod.CURSOR_COMPACT_MIN_BYTES = 0  # compact as often as the rule allows: kills land in compactions too
    st = TrajectoryStore(sys.argv[1])
    pending = st.pending_rollouts()
    for i, rid in enumerate(pending):
        st.mark_trained([rid], step=i)
        print(i + 1, flush=True)  # acknowledged
""")


def test_kill_9_while_marking_keeps_every_acknowledged_step(tmp_path):
    d = str(tmp_path)
    _store_with_outcomes(d, 3000).close()
    p = subprocess.Popen([sys.executable, "-c", MARKER, d], stdout=subprocess.PIPE, text=True, cwd=REPO)
    acked = 0
    for line in p.stdout:
        acked = int(line)
        if acked >= 300:
            break
    p.send_signal(signal.SIGKILL)
    p.wait()
    st = TrajectoryStore(d)
    n = len(st.consumed())
    assert 300 <= acked <= n < 3000 and sorted(st.consumed().values(), key=lambda e: e["step"])[-1]["step"] == n - 1
    st.mark_trained(st.pending_rollouts()[:1], step=n)  # the cursor takes writes again
    st.close()


def _cursor_bytes(d: str, steps: int, monkeypatch) -> tuple[list[int], int]:
    """Bytes the cursor writes (journal lines + snapshots) at each of ``steps`` steps of 4 rollouts, and the
    size of the snapshot that holds all of them."""
    from gyre_jax.trajectory import cursor as store_mod

    st = TrajectoryStore(d, run_id="run", config=StoreConfig(fsync="never"))
    for s in range(steps):
        for k in range(4):
            st.append(call(f"r{s}-{k}", 0, n_prompt=2, n_out=1))
            st.append(outcome(f"r{s}-{k}"))
    written = [0]
    real_atomic, real_write = store_mod._atomic_write_json, TrajectoryStore.journal_write

    def atomic(path, obj):
        real_atomic(path, obj)
        written[0] += os.path.getsize(path)

    def jwrite(fd, line, offset):
        written[0] += len(line)
        return real_write(fd, line, offset)

    monkeypatch.setattr(store_mod, "_atomic_write_json", atomic)
    monkeypatch.setattr(TrajectoryStore, "journal_write", staticmethod(jwrite))
    monkeypatch.setattr(store_mod, "CURSOR_COMPACT_MIN_BYTES", 256)  # compactions within a short run
    per_step = []
    for s in range(steps):
        before = written[0]
        st.mark_trained([f"r{s}-{k}" for k in range(4)], step=s)
        per_step.append(written[0] - before)
    monkeypatch.undo()
    st.restore_cursor(st.cursor_state())  # one snapshot of everything: its size per step is the law's E
    st.close()
    with TrajectoryStore(d, writable=False) as disk:  # and what was written is the whole cursor
        assert len(disk.consumed()) == 4 * steps
    return per_step, os.path.getsize(os.path.join(d, "cursor.json"))


@pytest.mark.parametrize("steps", [150, 300])
def test_the_cursor_writes_bytes_linear_in_the_steps(tmp_path, monkeypatch, steps):
    """Issue 33 item 6: a whole-cursor rewrite per step is O(steps^2) bytes over a run. The journal (a line of
    L bytes per step) is compacted when it outgrows the snapshot (E bytes per step done), so compactions come at
    steps growing by a factor 1 + E/L and all of them together write at most (L + E) bytes per step: the run
    writes at most 2L + E per step, however long it is (a rewrite per step: E x steps / 2 per step)."""
    per_step, snapshot = _cursor_bytes(str(tmp_path), steps, monkeypatch)
    line, e = 1.05 * min(per_step), snapshot / steps  # a step that compacts nothing writes its line (+ digits)
    assert sum(per_step) / steps <= 2 * line + e, (sum(per_step) / steps, line, e)
    assert sum(1 for b in per_step if b > 2 * line) >= 3  # compactions happened (the law is not a journal-only one)
