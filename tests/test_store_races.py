"""A reader of the trajectory store racing its writer, with the interleaving forced (pipes and events, no sleeps).

* A reader process scanning a torn tail while a writer opens the store and cuts that tail off: the reader
  must neither die (a mapped page past the new end of the file is SIGBUS) nor index anything of the tail,
  and it sees the writer's next frame on its next refresh.
* A reader loading the cursor between its snapshot and its journal while the writer compacts the journal
  into a new snapshot and empties it: the reader must not end up with the old snapshot and the empty journal
  (every rollout consumed since the old snapshot would look pending).
"""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import threading

from test_store import call, outcome

from gyre_jax.trajectory import cursor as cursor_mod
from gyre_jax.trajectory import store as store_mod
from gyre_jax.trajectory.cursor import Cursor
from gyre_jax.trajectory.store import LOG_NAME, TrajectoryStore

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

READER = textwrap.dedent("""
    import sys
    from gyre_jax.trajectory import frame_log as store_mod
    from gyre_jax.trajectory.store import TrajectoryStore

    real_scan, paused = store_mod._scan, []

    def scan(*a, **kw):  # the first look at bytes that are not a good frame: wait for the writer
        if not paused:
            paused.append(1)
            print("scanning", flush=True)
            sys.stdin.readline()
        return real_scan(*a, **kw)

    store_mod._scan = scan
    st = TrajectoryStore(sys.argv[1], writable=False)
    print("ids", sorted(st.rollout_ids()), st.stats().tail_pending_bytes > 0, flush=True)
    sys.stdin.readline()  # the writer appended once more
    st.refresh()
    print("ids", sorted(st.rollout_ids()), st.stats().tail_pending_bytes, flush=True)
""")


def test_a_reader_scanning_a_torn_tail_survives_the_writer_cutting_it(tmp_path):
    d = str(tmp_path)
    with TrajectoryStore(d, run_id="run") as st:
        for r in ("a", "b"):
            st.append(call(r, 0))
            st.append(outcome(r))
    with open(os.path.join(d, LOG_NAME), "ab") as f:  # a kill -9 mid-frame: a header and 64 KiB of a payload
        f.write(store_mod._FRAME.pack(store_mod.MAGIC, 1 << 20, 0) + b"\x01" * (64 << 10))
    p = subprocess.Popen([sys.executable, "-c", READER, d], cwd=REPO, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True)
    try:
        assert p.stdout.readline() == "scanning\n"
        w = TrajectoryStore(d, run_id="run")  # the writer's open cuts the torn tail off under the reader
        assert [t[1] for t in w.torn_tails()] == [store_mod._FRAME.size + (64 << 10)]
        p.stdin.write("go\n")
        p.stdin.flush()
        first = p.stdout.readline()
        w.append(call("c", 0))
        w.close()
        p.stdin.write("go\n")
        p.stdin.flush()
        second = p.stdout.readline()
        p.wait(60)
    finally:
        p.kill()
    assert p.returncode == 0, (p.returncode, p.stderr.read()[-2000:])  # -7 is SIGBUS
    assert first == "ids ['a', 'b'] True\n" and second == "ids ['a', 'b', 'c'] 0\n", (first, second)


def test_a_reader_loading_the_cursor_during_a_compaction_sees_every_consumed_rollout(tmp_path, monkeypatch):
    d = str(tmp_path)
    w = TrajectoryStore(d, run_id="run")
    for i in range(12):
        w.append(call(f"r{i}", 0))
        w.append(outcome(f"r{i}"))
    monkeypatch.setattr(cursor_mod, "CURSOR_COMPACT_MIN_BYTES", 1 << 30)  # ten journal lines, no snapshot yet
    for i in range(10):
        w.mark_trained([f"r{i}"], step=i)
    snapshot_read, compacted = threading.Event(), threading.Event()
    real_check = Cursor.check

    def check_cursor(self, state):  # called between reading the snapshot and reading the journal
        if not self.writable and not snapshot_read.is_set():
            snapshot_read.set()
            assert compacted.wait(60)
        return real_check(self, state)

    monkeypatch.setattr(Cursor, "check", check_cursor)
    seen: list = []
    reader = threading.Thread(target=lambda: seen.append(TrajectoryStore(d, writable=False).consumed()))
    reader.start()
    assert snapshot_read.wait(60)
    monkeypatch.setattr(cursor_mod, "CURSOR_COMPACT_MIN_BYTES", 0)
    w.mark_trained(["r10"], step=10)  # the journal outgrows the (absent) snapshot: compacted, then emptied
    assert os.path.getsize(os.path.join(d, "cursor.jsonl")) == 0
    compacted.set()
    reader.join(60)
    assert not reader.is_alive() and sorted(seen[0]) == sorted(w.consumed()) == sorted(f"r{i}" for i in range(11))
    w.close()
