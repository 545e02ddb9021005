"""A task's test suite, run by the ``run_tests`` tool in the rollout's sandbox.

Real test suites take seconds to minutes of wall time, and during that time the rollout
holds no decode slot: the environment, not the model, is the bottleneck. That is the time
an elastic scheduler can hand to training. :class:`TestSuite` makes it real here: the tool
starts a real subprocess in the rollout's sandbox (bubblewrap / container / plain bash,
like ``run``) that checks the workspace against the task's expectation case by case and
takes ``duration_s`` of wall time doing so.

Why the subprocess *waits* rather than computes: on a cluster the suites run on sandbox
hosts, not on the accelerators' host; on this 2-core machine a CPU-burning suite would
steal the cores training runs on and measure contention, not scheduling. Each case's
share of the duration is spent in ``time.sleep`` inside the sandboxed process, so the
trainer's event loop is free while it runs, exactly as with a remote suite.

Proof it ran: after the suite exits, the trainer (never the agent) writes
:data:`RECEIPT_FILE` in the workspace holding an HMAC, keyed by the task's secret
``receipt_key`` (in the task params: the grader gets them on stdin, the agent never sees
them), of the bytes the suite tested. The grader recomputes it on the final workspace, so
an agent can neither forge a receipt nor test one answer and submit another.
"""
from __future__ import annotations

import dataclasses
import hashlib
import hmac
import json
import math
import random

RECEIPT_FILE = ".test_receipt"
# Ran by `python3 -c` in the sandbox, argv[1] the JSON spec (no secrets: the expected
# answer's hash and length only). Prints one line per case, pytest-like, then a summary.
RUNNER = r"""
import hashlib, json, sys, time
spec = json.loads(sys.argv[1])
t0 = time.monotonic()
try:
    with open(spec["file"], "rb") as f:
        got = f.read().strip()
except OSError as e:
    got = None
cases = [
    ("test_file_exists", got is not None),
    ("test_length", got is not None and len(got) == spec["length"]),
    ("test_content", got is not None and hashlib.sha256(got).hexdigest() == spec["sha256"]),
]
passed = 0
for k, (name, ok) in enumerate(cases):
    time.sleep(max(0.0, t0 + spec["duration_s"] * (k + 1) / len(cases) - time.monotonic()))
    passed += ok
    print(f"{name} {'PASSED' if ok else 'FAILED'}", flush=True)
print(f"{passed} passed, {len(cases) - passed} failed")
sys.exit(0 if passed == len(cases) else 1)
"""


@dataclasses.dataclass(frozen=True, kw_only=True)
class TestSuite:
    """What ``run_tests`` runs for one task (built by the family's ``test_suite(task)``)."""
    __test__ = False  # not a pytest class
    answer_file: str  # workspace-relative file the suite tests
    expected: str  # what it should hold (stripped); only its hash and length reach the sandbox
    duration_s: float  # wall time the suite takes
    receipt_key: str  # HMAC key of the receipt (task params; never shown to the agent)

    def __post_init__(self):
        if not math.isfinite(self.duration_s) or self.duration_s < 0:
            raise ValueError(f"TestSuite.duration_s must be finite and >= 0, got {self.duration_s!r}")
        if not self.receipt_key:
            raise ValueError("TestSuite.receipt_key must be non-empty")

    @property
    def timeout_s(self) -> float:
        """The command's wall-time limit: the suite's own time plus sandbox start-up slack."""
        return self.duration_s * 1.5 + 15.0

    def command(self) -> str:
        spec = {"file": self.answer_file, "length": len(self.expected.encode()),
                "sha256": hashlib.sha256(self.expected.encode()).hexdigest(), "duration_s": self.duration_s}
        return f"exec python3 -c {_quote(RUNNER)} {_quote(json.dumps(spec))}"


def _quote(s: str) -> str:
    return "'" + s.replace("'", "'\"'\"'") + "'"


def receipt(key: str, tested: bytes) -> str:
    return hmac.new(key.encode(), tested, hashlib.sha256).hexdigest()


def receipt_valid(key: str, receipt_text: str | None, answer: bytes | None) -> bool:
    """The receipt in the workspace matches the final answer's bytes (tests ran on it)."""
    if receipt_text is None or answer is None:
        return False
    return hmac.compare_digest(receipt_text.strip(), receipt(key, answer))


def heavy_tailed_seconds(seed: int, *, low_s: float = 1.0, high_s: float = 30.0, median_s: float = 3.0,
                         sigma: float = 1.0) -> float:
    """A deterministic suite time for ``seed``: log-normal (median ``median_s``, log-sd
    ``sigma``) clipped to [low_s, high_s]. With the defaults: median 3 s, mean ~4.9 s,
    p90 ~11 s, ~14% at the 1 s floor and ~1% at the 30 s cap; the shape of CI suite times, whose long
    tail (integration tests, a slow fixture) is what makes a step's rollouts wait."""
    if not 0 < low_s <= median_s <= high_s:
        raise ValueError(f"heavy_tailed_seconds: need 0 < low_s <= median_s <= high_s, got {low_s}, {median_s}, "
                         f"{high_s}")
    z = random.Random(f"run_tests:{seed}").gauss(0.0, 1.0)
    return float(min(high_s, max(low_s, median_s * math.exp(sigma * z))))
