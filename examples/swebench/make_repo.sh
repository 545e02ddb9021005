#!/bin/bash
# Rebuilds repos/gyre__calc.bundle, the tiny repository instances.jsonl's instances are set in.
# Commits are made with fixed names and dates, so the commit ids in instances.jsonl come out the same.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
export GIT_AUTHOR_NAME=gyre GIT_AUTHOR_EMAIL=gyre@example.com GIT_COMMITTER_NAME=gyre GIT_COMMITTER_EMAIL=gyre@example.com
export GIT_AUTHOR_DATE="2026-12-06T00:00:00Z" GIT_COMMITTER_DATE="2026-12-06T00:00:00Z"
cd "$tmp"
git init -q -b main calc && cd calc
mkdir -p tests
cat > calc.py <<'PY'
def add(a, b):
    return a - b


def sub(a, b):
    return a - b


def div(a, b):
    return a / b
PY
cat > tests/test_calc.py <<'PY'
from calc import sub


def test_sub():
    assert sub(5, 3) == 2
PY
git add -A && git -c core.hooksPath=/dev/null commit -q -m "calc: add, sub, div"
git bundle create -q "$here/repos/gyre__calc.bundle" HEAD main
git rev-parse HEAD
