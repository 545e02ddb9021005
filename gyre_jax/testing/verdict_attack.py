"""Attack code for the reward-integrity battery and tests (tools/bench_reward_hacks.py,
tests/test_reward_redteam.py): graded code that reaches the per-test verdict's channel from inside the
test process, the descriptor (and a nonce, if any) read back from /proc/self/environ, which
os.environ.pop does not clear. Prepended to a module the graded test imports; it defines ``_rec(**record)``
(append a verdict record) and ``_passed(nodeid)`` (forge a passing test's phases)."""
import textwrap

VERDICT_FD = textwrap.dedent('''
    import atexit, json, os, sys
    _env = dict(kv.split(b"=", 1) for kv in open("/proc/self/environ", "rb").read().split(b"\\0") if b"=" in kv)
    _fd = int(_env[b"GYRE_VERDICT"].decode().rsplit("/", 1)[1])
    _nonce = _env.get(b"GYRE_VERDICT_NONCE", b"").decode()
    def _rec(**r):
        g = sys.modules.get("gyre_verdict")
        if g is not None and "seq" in getattr(g, "_state", {}):
            r["seq"] = g._state["seq"]
            g._state["seq"] += 1
        os.write(_fd, (json.dumps({**r, "nonce": _nonce}) + "\\n").encode())
    def _passed(nodeid="tests/test_calc.py::test_add"):
        for when in ("setup", "call", "teardown"):
            _rec(e="phase", nodeid=nodeid, when=when, outcome="passed", canary=False, longrepr="")
''')
