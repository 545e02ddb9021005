"""A person's log opens with our own lines (issue 31 item 9).

TensorFlow, pulled in by JetStream's seqio import, printed a screen of notices on a CPU machine
("failed call to cuInit", oneDNN, "All log messages before absl::InitializeLog()") that no log
level silences; jetstream_compat imports JetStream without it. Checked in a fresh process, as the
launcher starts: its import path, both jobs that serve, and the JetStream engine API.
"""
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NOISE = ("cuInit", "oneDNN", "absl::InitializeLog", "cuda drivers", "TF_ENABLE_ONEDNN_OPTS", "tensorflow")
SCRIPT = """
import sys
import launch.main
from gyre_jax import jobs
for name in ("rl", "serve"):
    jobs.get(name)
import gyre_jax.serving.engine, gyre_jax.serving.jetstream_backend
heavy = {m.split(".")[0] for m in sys.modules} & {"tensorflow", "seqio", "tensorflow_text", "tensorflow_datasets"}
print("heavy:", sorted(heavy))
"""


def test_launcher_start_prints_no_tensorflow_or_cuda_noise():
    env = {k: v for k, v in os.environ.items() if not k.startswith("TF_")}  # no help from the caller's shell
    r = subprocess.run([sys.executable, "-c", SCRIPT], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "heavy: []" in r.stdout, r.stdout
    noisy = [line for line in r.stderr.splitlines() if any(n in line for n in NOISE)]
    assert not noisy, noisy
