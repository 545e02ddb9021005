#!/bin/bash
# The reward: the fraction of /tests/test_calc.py's tests that pass (partial credit).
mkdir -p /logs/verifier
cd /app
PYTHONPATH=/app python3 -m pytest -q -p no:cacheprovider /tests/test_calc.py --junitxml=/logs/verifier/junit.xml
python3 - <<'PY'
import xml.etree.ElementTree as ET

root = ET.parse("/logs/verifier/junit.xml").getroot()
suite = root if root.tag == "testsuite" else root[0]
n = int(suite.get("tests"))
bad = sum(int(suite.get(k, 0)) for k in ("failures", "errors", "skipped"))
open("/logs/verifier/reward.txt", "w").write(str((n - bad) / n if n else 0.0))
PY
