"""MetricsWriter: real TensorBoard event files (read back through our own TFRecord parser) and a JSONL."""
import glob
import json
import os
import struct
import subprocess
import sys

import jax.numpy as jnp
import numpy as np
import pytest
from tensorboardX.proto.event_pb2 import Event, SessionLog

from gyre_jax.rl.metrics import MetricsWriter, flatten_metrics


def _crc32c(data: bytes) -> int:
    """Castagnoli CRC, bitwise (independent of tensorboardX's table implementation)."""
    crc = 0xFFFFFFFF
    for b in data:
        crc ^= b
        for _ in range(8):
            crc = (crc >> 1) ^ (0x82F63B78 if crc & 1 else 0)
    return crc ^ 0xFFFFFFFF


def _masked(data: bytes) -> int:
    c = _crc32c(data)
    return ((((c >> 15) | (c << 17)) & 0xFFFFFFFF) + 0xA282EAD8) & 0xFFFFFFFF


def read_events(path):
    """TFRecord framing: u64 length, masked crc32c(length), payload, masked crc32c(payload)."""
    out = []
    with open(path, "rb") as f:
        buf = f.read()
    off = 0
    while off < len(buf):
        (n,) = struct.unpack_from("<Q", buf, off)
        (len_crc,) = struct.unpack_from("<I", buf, off + 8)
        assert len_crc == _masked(buf[off : off + 8]), f"bad length crc at {off}"
        payload = buf[off + 12 : off + 12 + n]
        (crc,) = struct.unpack_from("<I", buf, off + 12 + n)
        assert crc == _masked(payload), f"bad payload crc at {off}"
        ev = Event()
        ev.ParseFromString(payload)
        out.append(ev)
        off += 12 + n + 4
    assert off == len(buf)
    return out


def scalars(events):
    got = {}
    for ev in events:
        for v in ev.summary.value:
            if v.HasField("simple_value"):
                got.setdefault(v.tag, []).append((ev.step, v.simple_value))
    return got


def event_files(d):
    return sorted(glob.glob(os.path.join(d, "events.out.tfevents.*")))


def jsonl(path):
    with open(path) as f:
        return [json.loads(line) for line in f]


def test_event_files_and_jsonl(tmp_path):
    d = str(tmp_path)
    steps = [(0, 0.25), (1, 0.5), (2, 0.8125)]
    with MetricsWriter(d, process_index=0) as w:
        for s, r in steps:
            w.write(s, {"reward": np.float32(r), "failures": {"timeout": s, "infra_error": jnp.int32(1)},
                        "ok": True, "roles": "train,serve"}, walltime=100.0 + s)
    (ev_file,) = event_files(d)
    evs = read_events(ev_file)
    assert evs[0].file_version.startswith("brain.Event:")
    sc = scalars(evs)
    assert sc["reward"] == [(s, np.float32(r)) for s, r in steps]
    assert sc["failures/timeout"] == [(s, float(s)) for s, _ in steps]
    assert sc["failures/infra_error"] == [(s, 1.0) for s, _ in steps]
    assert sc["ok"] == [(s, 1.0) for s, _ in steps]
    texts = [ev for ev in evs for v in ev.summary.value if v.tag.startswith("roles")]
    assert [ev.step for ev in texts] == [0, 1, 2]
    assert all(ev.wall_time == 100.0 + ev.step for ev in evs if ev.summary.value)
    lines = jsonl(os.path.join(d, "metrics.jsonl"))
    assert lines == [{"step": s, "time": 100.0 + s, "reward": r, "failures/timeout": s, "failures/infra_error": 1,
                      "ok": 1, "roles": "train,serve"} for s, r in steps]


def test_only_process_zero_writes(tmp_path):
    w = MetricsWriter(str(tmp_path / "p1"), process_index=1)
    w.write(0, {"reward": 1.0})
    with pytest.raises(ValueError, match="metric 'x'"):  # other processes still check their input
        w.write(1, {"x": [1, 2]})
    w.close()
    assert not os.path.exists(tmp_path / "p1")


def test_bad_metrics_are_named(tmp_path):
    w = MetricsWriter(str(tmp_path), process_index=0)
    with pytest.raises(ValueError, match=r"metric 'a/b' must be a scalar, got an array of shape \(2,\)"):
        w.write(0, {"a": {"b": np.zeros(2)}})
    with pytest.raises(ValueError, match="metric 'c': expected a number, string or dict, got NoneType"):
        w.write(0, {"c": None})
    with pytest.raises(ValueError, match="reserved"):
        w.write(0, {"step": 1})
    with pytest.raises(ValueError, match="given twice"):
        flatten_metrics({"a/b": 1, "a": {"b": 2}})
    w.write(3, {"r": 1.0})
    with pytest.raises(ValueError, match="step 3 after step 3"):
        w.write(3, {"r": 1.0})
    w.close()
    with pytest.raises(RuntimeError, match="closed"):
        w.write(4, {"r": 1.0})
    with pytest.raises(ValueError, match="step 3 after step 3"):  # reopened without purge_step
        MetricsWriter(str(tmp_path), process_index=0).write(3, {"r": 2.0})


def test_resume_purges_steps_of_the_crashed_attempt(tmp_path):
    d = str(tmp_path)
    w = MetricsWriter(d, process_index=0)
    for s in range(5):
        w.write(s, {"loss": float(s)}, walltime=1.0)
    w.flush()  # then "crash": never closed
    with open(os.path.join(d, "metrics.jsonl"), "a") as f:
        f.write('{"step": 5, "lo')  # a line cut by the crash
    w2 = MetricsWriter(d, purge_step=3, process_index=0)  # the checkpoint said: resume at step 3
    for s in (3, 4):
        w2.write(s, {"loss": 10.0 + s}, walltime=2.0)
    w2.close()
    assert [(r["step"], r["loss"]) for r in jsonl(os.path.join(d, "metrics.jsonl"))] == [
        (0, 0.0), (1, 1.0), (2, 2.0), (3, 13.0), (4, 14.0)]
    with open(os.path.join(d, "metrics.purged.jsonl")) as f:
        purged = f.read().splitlines()
    assert [json.loads(x)["step"] for x in purged[:2]] == [3, 4] and purged[2] == '{"step": 5, "lo'
    newest = read_events(event_files(d)[-1])
    starts = [ev.step for ev in newest if ev.HasField("session_log") and ev.session_log.status == SessionLog.START]
    assert starts == [3]  # TensorBoard hides the crashed attempt's events of steps >= 3
    assert scalars(newest)["loss"] == [(3, 13.0), (4, 14.0)]


def _wandb_history(run_file: str) -> list[dict]:
    """History rows of an offline W&B run file: a LevelDB-style log (32 KiB blocks of records
    with a 7-byte header: crc32, length, type full/first/middle/last) of protobuf Records."""
    from wandb.proto import wandb_internal_pb2 as pb

    data = open(run_file, "rb").read()
    pos, block, recs, buf = 7, 32768, [], b""
    while pos + 7 <= len(data):
        if block - pos % block < 7:  # a block's tail too short for a header is padding
            pos += block - pos % block
            continue
        _, n, kind = struct.unpack("<IHB", data[pos:pos + 7])
        chunk, pos = data[pos + 7:pos + 7 + n], pos + 7 + n
        if kind == 0:
            break
        buf = chunk if kind in (1, 2) else buf + chunk
        if kind in (1, 4):
            recs.append(buf)
    rows = []
    for d in recs:
        r = pb.Record()
        r.ParseFromString(d)
        if r.WhichOneof("record_type") == "history":
            rows.append({i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in r.history.item})
    return rows


def test_wandb_offline_gets_what_the_jsonl_gets(tmp_path, monkeypatch):
    pytest.importorskip("wandb")
    from gyre_jax.rl.sinks.wandb import WandbOptions

    monkeypatch.setenv("WANDB_SILENT", "true")
    # In a process of its own that then exits, as a run does before `wandb sync`: W&B's service may still
    # hold the file's last records in its buffer when finish() returns (seen once on a loaded machine: the
    # file had no history yet), and writes them out when the process ends.
    code = (
        "from gyre_jax.rl.metrics import MetricsWriter\n"
        "from gyre_jax.rl.sinks.wandb import WandbOptions\n"
        f"w = MetricsWriter({str(tmp_path / 'run')!r}, process_index=0,"
        " sinks={'tensorboard': None, 'wandb': WandbOptions(mode='offline')}, run_config={'seed': 3})\n"
        "for step in range(3):\n"
        "    w.write(step, {'reward': 0.5 + step, 'groups': 'g1,g2', 'failures': {'timeout': step}})\n"
        "w.close()\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    [run_file] = glob.glob(str(tmp_path / "run" / "wandb" / "wandb" / "offline-run-*" / "*.wandb"))
    rows = _wandb_history(run_file)
    assert [(r["_step"], r["reward"], r["failures/timeout"]) for r in rows] == [(0, 0.5, 0), (1, 1.5, 1), (2, 2.5, 2)]
    jsonl = [json.loads(line) for line in open(tmp_path / "run" / "metrics.jsonl")]
    assert [r["reward"] for r in jsonl] == [r["reward"] for r in rows]
    with pytest.raises(ValueError, match="metrics.sink_options.wandb.mode"):
        WandbOptions(mode="cloud")
