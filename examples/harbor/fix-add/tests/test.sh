#!/bin/bash
# The reward: the fraction of checks of /app/calc.py that pass. Each check runs the agent's code in its
# own Python process and compares what it printed: nothing that code does reaches this script or its reward.
mkdir -p /logs/verifier
pass=0
total=0
check() {  # check EXPRESSION EXPECTED
  total=$((total + 1))
  got=$(cd /app && timeout 10 python3 -I -c "import sys; sys.path.insert(0, '.'); from calc import add, sub; print(repr($1))" </dev/null 2>/dev/null)
  if [ "$got" = "$2" ]; then pass=$((pass + 1)); fi
}
check "add(2, 3)" 5
check "add(-1, 1)" 0
check "sub(5, 3)" 2
python3 -c "print($pass / $total)" > /logs/verifier/reward.txt
