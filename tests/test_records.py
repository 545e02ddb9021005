"""Record schema: validation names the record and the field; encodings round-trip exactly."""
import json

import numpy as np
import pytest

from gyre_jax.trajectory.records import (
    ModelCallRecord,
    RecordError,
    RolloutOutcome,
    record_from_bytes,
    record_from_dict,
    record_from_json,
)


def call_kw(**over):
    kw = dict(
        run_id="run-1", rollout_id="r-7", task_id="task/a", group_id="g0", agent_id=0, parent_agent_id=None,
        role="main", call_index=3, prompt_ids=[5, 6, 7], output_ids=[8, 9], output_logprobs=[-0.5, -1.25],
        policy_version=2, t_start=10.0, t_end=12.5, finish_reason="stop",
    )
    kw.update(over)
    return kw


def outcome_kw(**over):
    kw = dict(run_id="run-1", rollout_id="r-7", task_id="task/a", group_id="g0", status="completed", score=0.75,
              details={"tests_passed": 3, "tests_total": 4}, policy_versions=(1, 2), t_end=20.0, num_calls=4)
    kw.update(over)
    return kw


def test_call_arrays_are_typed_and_frozen():
    src = np.array([5, 6, 7], np.int64)
    r = ModelCallRecord(**call_kw(prompt_ids=src))
    assert r.prompt_ids.dtype == np.int32 and r.output_logprobs.dtype == np.float32
    src[0] = 99  # the record holds its own copy
    assert r.prompt_ids[0] == 5
    with pytest.raises(ValueError):
        r.prompt_ids[0] = 1
    with pytest.raises(AttributeError):
        r.role = "summary"
    np.testing.assert_array_equal(r.sequence, [5, 6, 7, 8, 9])


@pytest.mark.parametrize("enc", ["bytes", "json", "dict"])
def test_call_round_trip_exact(enc):
    rng = np.random.default_rng(0)
    r = ModelCallRecord(**call_kw(prompt_ids=rng.integers(0, 2**31 - 1, 1000), output_ids=rng.integers(0, 150000, 300),
                                  output_logprobs=-rng.exponential(size=300), role="subagent", agent_id=4, parent_agent_id=0))
    back = {"bytes": lambda: record_from_bytes(r.to_bytes()), "json": lambda: record_from_json(r.to_json()),
            "dict": lambda: record_from_dict(json.loads(json.dumps(r.to_dict())))}[enc]()
    assert isinstance(back, ModelCallRecord)
    for f in ("prompt_ids", "output_ids", "output_logprobs"):
        a, b = getattr(r, f), getattr(back, f)
        assert a.dtype == b.dtype and a.tobytes() == b.tobytes()  # bit-exact
    for f in ("run_id", "rollout_id", "task_id", "group_id", "agent_id", "parent_agent_id", "role", "call_index",
              "policy_version", "t_start", "t_end", "finish_reason"):
        assert getattr(r, f) == getattr(back, f), f
    # Compact: 4 bytes per prompt token, 8 per output token, plus a small header.
    assert len(r.to_bytes()) < 4 * 1000 + 8 * 300 + 400


def test_outcome_round_trip():
    o = RolloutOutcome(**outcome_kw())
    for back in (record_from_bytes(o.to_bytes()), record_from_json(o.to_json())):
        assert back.to_dict() == o.to_dict()
    assert not o.is_failure
    assert RolloutOutcome(**outcome_kw(status="verifier_error", score=None)).is_failure


def test_empty_output_allowed():
    r = ModelCallRecord(**call_kw(output_ids=[], output_logprobs=[], finish_reason="abort"))
    assert r.output_ids.shape == (0,) and r.output_ids.dtype == np.int32
    assert record_from_bytes(r.to_bytes()).output_ids.shape == (0,)


BAD_CALLS = [
    (dict(run_id=""), "run_id", "length 0"),
    (dict(rollout_id=7), "rollout_id", "must be a str"),
    (dict(task_id="a\nb"), "task_id", "non-printable"),
    (dict(call_index=-1), "call_index", "not in [0,"),
    (dict(call_index=True), "call_index", "must be an int"),
    (dict(agent_id=2**31), "agent_id", "not in [0,"),
    (dict(role="critic"), "role", "unknown role 'critic'"),
    (dict(role="main", parent_agent_id=1), "parent_agent_id", "must be None for role 'main'"),
    (dict(role="subagent", agent_id=2, parent_agent_id=None), "parent_agent_id", "needs its parent"),
    (dict(role="subagent", agent_id=2, parent_agent_id=2), "parent_agent_id", "not its own parent"),
    (dict(prompt_ids=[]), "prompt_ids", "at least 1"),
    (dict(prompt_ids=[[1, 2]]), "prompt_ids", "must be 1-D"),
    (dict(prompt_ids=[1.0, 2.0]), "prompt_ids", "must be integers"),
    (dict(prompt_ids=[1, -3]), "prompt_ids", "token id -3 at index 1"),
    (dict(output_ids=[1, 2**31]), "output_ids", "at index 1"),
    (dict(output_logprobs=[-0.5]), "output_logprobs", "has 1 entries but output_ids has 2"),
    (dict(output_logprobs=[-0.5, 0.1]), "output_logprobs", "at index 1 must be finite and <= 0"),
    (dict(output_logprobs=[np.nan, -1.0]), "output_logprobs", "at index 0 must be finite"),
    (dict(output_logprobs=["a", "b"]), "output_logprobs", "real numbers"),
    (dict(policy_version=-2), "policy_version", "not in [0,"),
    (dict(t_end=9.0), "t_end", "before t_start"),
    (dict(t_start=float("inf")), "t_start", "finite"),
    (dict(finish_reason="eos"), "finish_reason", "unknown finish reason 'eos'"),
]


@pytest.mark.parametrize("over,field,msg", BAD_CALLS, ids=[b[1] + ":" + b[2] for b in BAD_CALLS])
def test_bad_call_names_record_and_field(over, field, msg):
    with pytest.raises(RecordError) as ei:
        ModelCallRecord(**call_kw(**over))
    e = ei.value
    assert e.field == field
    assert msg in str(e), str(e)
    if field not in ("rollout_id", "call_index"):
        assert "rollout_id='r-7', call_index=3" in str(e)


BAD_OUTCOMES = [
    (dict(status="done"), "status", "unknown status 'done'"),
    (dict(score=1.5), "score", "not in [0, 1]"),
    (dict(score=float("nan")), "score", "not in [0, 1]"),
    (dict(status="timeout", score=None), "score", "partial credit"),
    (dict(status="infra_error", score=0.0), "score", "must be None"),
    (dict(details={"x": object()}), "details", "JSON-serializable"),
    (dict(details=[1]), "details", "must be a dict"),
    (dict(policy_versions=(1, -1)), "policy_versions", "not in [0,"),
    (dict(num_calls=-1), "num_calls", "not in [0,"),
]


@pytest.mark.parametrize("over,field,msg", BAD_OUTCOMES, ids=[b[1] + ":" + b[2] for b in BAD_OUTCOMES])
def test_bad_outcome_names_record_and_field(over, field, msg):
    with pytest.raises(RecordError) as ei:
        RolloutOutcome(**outcome_kw(**over))
    assert ei.value.field == field
    assert msg in str(ei.value) and "RolloutOutcome(rollout_id='r-7')" in str(ei.value)


def test_bad_encodings():
    r = ModelCallRecord(**call_kw())
    d = r.to_dict()
    with pytest.raises(RecordError, match="prompt_ids: bad base64"):
        record_from_dict({**d, "prompt_ids": "!!"})
    with pytest.raises(RecordError, match="output_logprobs: missing"):
        record_from_dict({k: v for k, v in d.items() if k != "output_logprobs"})
    with pytest.raises(RecordError, match=r"unknown field\(s\) \['colour'\]"):
        record_from_dict({**d, "colour": 1})
    with pytest.raises(RecordError, match="kind: must be 'call' or 'outcome'"):
        record_from_dict({**d, "kind": "blob"})
    with pytest.raises(RecordError, match="not valid JSON"):
        record_from_json("{")
    b = r.to_bytes()
    with pytest.raises(RecordError, match="header says"):
        record_from_bytes(b[:-4])
    # Plain JSON lists are accepted for arrays (hand-written or simple clients).
    back = record_from_dict({**d, "prompt_ids": [5, 6, 7], "output_ids": [8, 9], "output_logprobs": [-0.5, -1.25]})
    np.testing.assert_array_equal(back.prompt_ids, r.prompt_ids)


@pytest.mark.parametrize("enc", ["bytes", "json", "dict"])
@pytest.mark.parametrize("dtype, experts", [(np.uint8, 128), (np.uint16, 512)])
def test_call_routing_round_trips_and_costs_r_bytes_per_id(enc, dtype, experts):
    """Routing replay: an MoE engine's [output, R] expert ids (uint8 up to 256 experts, else uint16)."""
    rng = np.random.default_rng(1)
    n, width = 7, 48 * 8  # Qwen3-30B-A3B: 48 MoE layers x top-8
    routing = rng.integers(0, experts, (n, width)).astype(dtype)
    r = ModelCallRecord(**call_kw(output_ids=rng.integers(0, 1000, n), output_logprobs=-rng.random(n),
                                  output_routing=routing))
    back = {"bytes": lambda: record_from_bytes(r.to_bytes()), "json": lambda: record_from_json(r.to_json()),
            "dict": lambda: record_from_dict(json.loads(json.dumps(r.to_dict())))}[enc]()
    assert back.output_routing.dtype == dtype and back.output_routing.tobytes() == routing.tobytes()
    plain = ModelCallRecord(**call_kw(output_ids=r.output_ids, output_logprobs=r.output_logprobs))
    extra = len(r.to_bytes()) - len(plain.to_bytes())
    assert extra - n * width * np.dtype(dtype).itemsize < 40  # the ids plus the header's "routing": [R, code]
    assert record_from_bytes(plain.to_bytes()).output_routing is None  # a dense (or older) record reads as before


def test_bad_routing_names_the_field():
    with pytest.raises(RecordError, match=r"output_routing: must be \[output tokens = 2, R\]"):
        ModelCallRecord(**call_kw(output_routing=np.zeros((3, 4), np.uint8)))
    with pytest.raises(RecordError, match=r"output_routing: expert ids must be in \[0, 65535\]"):
        ModelCallRecord(**call_kw(output_routing=np.full((2, 4), -1, np.int32)))
    payload = ModelCallRecord(**call_kw(output_routing=np.zeros((2, 4), np.uint8))).to_bytes()
    with pytest.raises(RecordError, match="payload"):
        record_from_bytes(payload[:-4])
