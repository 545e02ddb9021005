"""tools/synth_rollouts.py writes a store that reads back into the same records and trees."""
import importlib.util
import json
import os

from gyre_jax.trajectory.store import TrajectoryStore
from gyre_jax.trajectory.synth import preset, synth_rollouts
from gyre_jax.trajectory.tree import rebuild

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_cli_writes_store(tmp_path, capsys):
    spec = importlib.util.spec_from_file_location("synth_cli", os.path.join(REPO, "tools", "synth_rollouts.py"))
    cli = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(cli)
    out = str(tmp_path / "store")
    res = cli.main(["--preset", "tiny", "--out", out, "--set", "group_size=2"])
    last = capsys.readouterr().out.strip().splitlines()[-1]
    assert json.loads(last) == json.loads(json.dumps(res))  # one final JSON line
    calls, outcomes = synth_rollouts(preset("tiny", group_size=2))
    with TrajectoryStore(out, writable=False) as st:
        s = st.stats()
        assert (s.calls, s.outcomes, s.quarantined) == (len(calls), len(outcomes), 0)
        assert st.pending_rollouts() == [o.rollout_id for o in outcomes]
        unique = 0
        for o in outcomes:
            back = st.calls(o.rollout_id)
            want = [c for c in calls if c.rollout_id == o.rollout_id]
            assert [c.to_bytes() for c in back] == [c.to_bytes() for c in want]
            assert st.outcome(o.rollout_id).to_dict() == o.to_dict()
            unique += rebuild(back).unique_tokens
    assert res["unique_tokens"] == unique and res["calls"] == len(calls)
