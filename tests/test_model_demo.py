"""The synthetic training job trains: a shrunken config through the real launcher's job table.

Its multi-process run (launch.main on two processes) is in tests/test_multihost.py.
"""
import json

import pytest

from configs import synthetic_train as demo_config
from gyre_jax import jobs


@pytest.mark.slow  # ~8 s alone (mostly compiling), ~20 s on a loaded machine
def test_demo_loss_falls(tmp_path):
    c = demo_config.get_config()
    c.steps = 60
    c.rows = 8  # one row per test device (the job splits rows over every device)
    c.row_len = 64
    c.prompt_len = 8
    c.node_len = 4
    c.log_every = 5
    c.model.d_model = 32
    c.model.head_dim = 8
    c.model.d_ff = 64
    c.model.max_seq_len = 64
    history = jobs.get(c.job)(c, str(tmp_path))
    lines = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in lines] == list(range(60)) and lines == history
    first = sum(r["loss"] for r in lines[:5]) / 5
    last = sum(r["loss"] for r in lines[-5:]) / 5
    assert last < first - 0.5, (first, last)
    assert all(r["trainable_tokens"] > 0 and r["fill"] > 0.5 for r in lines)


def test_rows_must_split_over_devices(tmp_path):
    """Data parallel over every device: a batch that does not split evenly is named before anything compiles."""
    c = demo_config.get_config()
    c.rows = 4  # the test run has 8 devices
    with pytest.raises(ValueError, match="rows=4 must be a multiple of the 8 devices"):
        jobs.get(c.job)(c, str(tmp_path))
