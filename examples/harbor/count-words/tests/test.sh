#!/bin/bash
# The reward: the fraction of lines of /app/counts.txt that are right.
mkdir -p /logs/verifier
python3 - <<'PY'
want = ["4", "1", "4"]
try:
    got = open("/app/counts.txt").read().split()
except OSError:
    got = []
right = sum(g == w for g, w in zip(got, want))
open("/logs/verifier/reward.txt", "w").write(str(right / len(want)))
PY
