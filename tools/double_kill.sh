#!/bin/bash
# Two kill -9s of the demo inside one checkpoint interval (at step 3, and again 12 s into the resume),
# then the same command to the end, and an audit of the workdir from the store's own records:
# every finished rollout trained exactly once, none unfinished, staleness within the bound (issue 33).
# Takes ~4 minutes on 2 cores. AT=step: the second kill comes once the resumed run reports step 1 instead,
# inside the oversized steps a rewind past the bound makes (policy.resume_step_sizes).
#   [AT=step] bash tools/double_kill.sh [WORKDIR]
set -u
cd "$(dirname "$0")/.."
W=${1:-/tmp/gyre_double_kill}; rm -rf "$W" "$W".*.log; mkdir -p "$W"
LOAD0=$(cut -d' ' -f1-3 /proc/loadavg)  # for the JSON header (tools/benchkit.py)
ARGS="--config configs/demo.py --workdir $W --config.sft.steps=20 --config.steps=10 --config.checkpoint_every=8 --config.eval.every=0"
.venv/bin/python -m launch.main $ARGS > "$W.1.log" 2>&1 & pid=$!
for _ in $(seq 1 600); do grep -q "step 3/10" "$W.1.log" 2>/dev/null && break; sleep 1; done
kill -9 $pid; wait $pid 2>/dev/null
echo "attempt 1: kill -9 at $(grep -o 'step [0-9]*/10' "$W.1.log" | tail -1); checkpoints: $(ls "$W/elastic/checkpoints" | tr '\n' ' ')"
.venv/bin/python -m launch.main $ARGS > "$W.2.log" 2>&1 & pid=$!
if [ "${AT:-}" = step ]; then
  for _ in $(seq 1 600); do grep -q "step 1/10" "$W.2.log" 2>/dev/null && break; sleep 1; done; when="at step 1/10"
else
  for _ in $(seq 1 600); do grep -q "resumed from" "$W.2.log" 2>/dev/null && break; sleep 1; done; sleep 12; when="12 s later"
fi
kill -9 $pid; wait $pid 2>/dev/null
echo "attempt 2: $(grep -h 'resumed from' "$W.2.log" | cut -c1-160); kill -9 $when"
.venv/bin/python -m launch.main $ARGS > "$W.3.log" 2>&1; rc=$?
echo "attempt 3: rc=$rc; $(grep -h 'resumed from' "$W.3.log" | cut -c1-160)"
.venv/bin/python - "$W" "$rc" "$LOAD0" "$SECONDS" <<'PY'
import json, os, sys
sys.path.insert(0, "tools")
import benchkit
from gyre_jax.trajectory.store import TrajectoryStore
w, rc = sys.argv[1], int(sys.argv[2])
bench = benchkit.Bench("double_kill.sh", None)
bench.load_before, bench.t0 = [float(x) for x in sys.argv[3].split()], bench.t0 - float(sys.argv[4])
s = json.load(open(f"{w}/elastic/summary.json"))
with TrajectoryStore(f"{w}/elastic/store", run_id="rl", writable=False) as st:
    outs = {r: st.outcome(r) for r in st.complete_rollouts()}
    cons = st.consumed()
    out = dict(rc=rc, run_steps=s["steps"], staleness_max=s["staleness_max"], finished=len(outs),
               rollouts_lost=len(set(outs) - set(cons)), unfinished=len(st.unfinished_rollouts()),
               trained=sum(e["state"] == "trained" for e in cons.values()),
               abandoned=sum("abandoned" in (o.details.get("error") or "") for o in outs.values()))
from gyre_jax.rl.audit import audit_workdir
au = audit_workdir(f"{w}/elastic", group_size=8, staleness_bound=1)  # configs/demo.py's
out.update({k: au[k] for k in ("rollouts_trained_twice", "groups_short", "max_staleness_over_bound",
                               "duplicate_steps", "oversized_steps", "extra_groups")})
bench.emit(out, sizes={"steps": 10, "sft_steps": 20, "checkpoint_every": 8, "second_kill": "at step 1" if os.environ.get("AT") == "step" else "12 s into the resume"})
PY
