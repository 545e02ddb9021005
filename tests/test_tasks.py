"""Task families: deterministic generation, validation, demonstrations that score 1."""
import json

import pytest

from gyre_jax.agents import tasks
from gyre_jax.agents.demos import demonstration
from gyre_jax.agents.tasks import repo_spec, tiny
from gyre_jax.agents.tasks.base import Task


@pytest.mark.parametrize("family", tasks.generated_families())
def test_generation_is_deterministic_and_round_trips(family):
    a, b = tasks.make_task(family, 9), tasks.make_task(family, 9)
    assert a == b and Task.from_json(a.to_json()) == a
    assert len({tasks.make_task(family, s).task_id for s in range(20)}) > 10


def test_tiny_expected_answers():
    assert tiny.expected_answer("reverse", "abc") == "cba"
    assert tiny.expected_answer("upper", "abc") == "ABC"
    assert tiny.expected_answer("sum", "1234") == "10"
    assert tiny.expected_answer("sort", "cab") == "abc"
    assert tiny.expected_answer("copy", "xyz") == "xyz"
    with pytest.raises(ValueError, match="unknown op"):
        tiny.expected_answer("rot13", "abc")
    with pytest.raises(ValueError, match="must be non-empty, made of"):
        tiny.expected_answer("sum", "12a")
    with pytest.raises(ValueError, match="ops must be"):
        tiny.make_task(0, ops=("nope",))


def test_repo_pool_references_are_right():
    # Independent of the pool's own cases: hand-computed values.
    ref = repo_spec._reference
    assert ref("fibonacci")(10) == 55 and ref("factorial")(5) == 120 and ref("gcd")(12, 18) == 6
    assert ref("running_sum")([1, 2, 3]) == [1, 3, 6] and ref("dedupe")([3, 1, 3]) == [3, 1]
    assert ref("is_prime")(97) and not ref("is_prime")(91) and ref("digits_sum")(9999) == 36
    assert ref("capitalize_words")("hello big  world") == "Hello Big World"
    with pytest.raises(ValueError, match="n_modules"):
        repo_spec.make_task(0, n_modules=9)


def test_tiny_demonstration_is_one_short_call():
    for seed in range(5):
        t = tiny.make_task(seed)
        d = demonstration(t, verify=True)
        assert d.score == 1.0
        assert [m["role"] for m in d.messages] == ["system", "user", "assistant"]
        assert d.messages[2]["content"] == (
            f'<tool>write_file {{"path": "answer.txt", "content": "{t.params["expected"]}"}}</tool>\n<tool>finish</tool>')
        assert sum(len(m["content"]) for m in d.messages) < 256  # fits a tiny byte-level model


@pytest.mark.parametrize("text_format", [True, False])
def test_repo_demonstration_scores_full(text_format):
    t = repo_spec.make_task(4, n_modules=1, functions_per_module=2)
    d = demonstration(t, text_format=text_format, verify=True)
    assert d.score == 1.0
    assert [m["role"] for m in d.messages if m["role"] == "assistant"] == ["assistant"] * 4
    assert d.messages[-1]["role"] == "assistant"
    assert [x["function"]["name"] for x in d.tools] == list(t.tools)


def test_task_validation_errors_name_the_problem():
    good = tiny.make_task(0).to_dict()
    cases = {
        "task_id": ("bad id", "Task.task_id"),
        "grader": ("no_colon", "grader must be 'module:function'"),
        "tools": (("write_file", "rm_rf"), "unknown tools"),
        "params": ({"x": object()}, "JSON-serializable"),
        "prompt": ("", "prompt must be"),
        "setup_files": ({"../x": "y"}, "relative path"),
    }
    for field, (value, msg) in cases.items():
        with pytest.raises(ValueError, match=msg):
            Task(**{**good, field: value})
    with pytest.raises(ValueError, match="unknown field"):
        Task.from_dict({**good, "colour": 1})
    with pytest.raises(LookupError, match="unknown task family"):
        tasks.make_task("nope", 0)
    json.loads(tiny.make_task(0).to_json())
