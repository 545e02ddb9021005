"""'Build a small repository from a spec': a package of modules with given functions.

A task asks for ``<pkg>/__init__.py``, a few ``<pkg>/<module>.py`` files each defining
given functions (signature, docstring, one example), and a ``README.md`` naming the
package and its modules. The grader checks it piece by piece, every check weighing the
same (score = passed / total):

  exists:<path>           each required file
  import:<pkg.module>     the module imports (within a time limit)
  defines:<pkg.mod.fn>    the function exists and is callable
  case:<pkg.mod.fn>[k]    hidden unit cases (the prompt shows case 0 only)
  readme:<word>           README.md mentions the package / each module

Agent code runs in ``check_runner`` subprocesses (one per module) inside the grader's
sandbox (``grader_sandbox.untrusted_python``), so a hang, crash or ``sys.exit`` in it fails its
checks instead of crashing the grader; the runner reports the values returned and this
grader compares them with the expected ones, which never reach agent code.
"""
from __future__ import annotations

import dataclasses
import json
import random
from pathlib import Path

from gyre_jax.agents.call_checks import run_module_checks, same_json
from gyre_jax.agents.check_runner import check_names, import_check_name
from gyre_jax.agents.scoring import Checks, Grade
from gyre_jax.agents.tasks import FAMILIES, family_options
from gyre_jax.agents.tasks.base import Task

FAMILY = "repo_spec"
README = "README.md"

# name -> (signature, docstring, reference source, case argument lists).
POOL: dict[str, tuple[str, str, str, list[list]]] = {
    "add": ("add(a, b)", "Return a + b.", "def add(a, b):\n    return a + b\n", [[2, 3], [-1, 1], [10, 32]]),
    "reverse_string": ("reverse_string(s)", "Return s reversed.",
                       "def reverse_string(s):\n    return s[::-1]\n", [["abc"], ["racecar!"], [""]]),
    "is_palindrome": ("is_palindrome(s)", "True if s reads the same backwards (case-sensitive).",
                      "def is_palindrome(s):\n    return s == s[::-1]\n", [["level"], ["abca"], ["Aa"]]),
    "count_vowels": ("count_vowels(s)", "Number of characters of s in 'aeiouAEIOU'.",
                     "def count_vowels(s):\n    return sum(c in 'aeiouAEIOU' for c in s)\n",
                     [["hello"], ["xyz"], ["AEIoux"]]),
    "factorial": ("factorial(n)", "n! for n >= 0.",
                  "def factorial(n):\n    out = 1\n    for k in range(2, n + 1):\n        out *= k\n    return out\n",
                  [[5], [0], [7]]),
    "fibonacci": ("fibonacci(n)", "The n-th Fibonacci number: fibonacci(0) == 0, fibonacci(1) == 1.",
                  "def fibonacci(n):\n    a, b = 0, 1\n    for _ in range(n):\n        a, b = b, a + b\n    return a\n",
                  [[10], [0], [1]]),
    "clamp": ("clamp(x, lo, hi)", "x limited to the range [lo, hi].",
              "def clamp(x, lo, hi):\n    return max(lo, min(hi, x))\n", [[5, 0, 3], [-2, 0, 3], [2, 0, 3]]),
    "word_count": ("word_count(text)", "Number of whitespace-separated words in text.",
                   "def word_count(text):\n    return len(text.split())\n", [["a b  c"], [""], ["one"]]),
    "max_of": ("max_of(xs)", "The largest element of the non-empty list xs.",
               "def max_of(xs):\n    return max(xs)\n", [[[3, 1, 2]], [[-5, -2]], [[7]]]),
    "flatten": ("flatten(xss)", "Concatenate a list of lists into one list.",
                "def flatten(xss):\n    return [x for xs in xss for x in xs]\n", [[[[1, 2], [3]]], [[[], [4]]], [[]]]),
    "running_sum": ("running_sum(xs)", "Prefix sums: running_sum([1, 2]) == [1, 3].",
                    "def running_sum(xs):\n    out, t = [], 0\n    for x in xs:\n        t += x\n        out.append(t)\n"
                    "    return out\n", [[[1, 2, 3]], [[]], [[5, -5, 2]]]),
    "dedupe": ("dedupe(xs)", "xs without repeats, keeping first occurrences in order.",
               "def dedupe(xs):\n    seen, out = set(), []\n    for x in xs:\n        if x not in seen:\n"
               "            seen.add(x)\n            out.append(x)\n    return out\n",
               [[[1, 2, 1, 3, 2]], [[]], [["a", "a"]]]),
    "gcd": ("gcd(a, b)", "Greatest common divisor of non-negative a and b (gcd(0, b) == b).",
            "def gcd(a, b):\n    while b:\n        a, b = b, a % b\n    return a\n", [[12, 18], [7, 5], [0, 9]]),
    "is_prime": ("is_prime(n)", "True if n is a prime number.",
                 "def is_prime(n):\n    if n < 2:\n        return False\n    k = 2\n    while k * k <= n:\n"
                 "        if n % k == 0:\n            return False\n        k += 1\n    return True\n",
                 [[2], [15], [97]]),
    "capitalize_words": ("capitalize_words(text)", "Each word with its first letter upper-cased, joined by "
                         "single spaces.", "def capitalize_words(text):\n    return ' '.join(w[:1].upper() + w[1:] "
                         "for w in text.split())\n", [["hello big world"], ["a"], [""]]),
    "digits_sum": ("digits_sum(n)", "Sum of the decimal digits of n >= 0.",
                   "def digits_sum(n):\n    return sum(int(c) for c in str(n))\n", [[123], [0], [9999]]),
}
PACKAGES = ("toolbox", "minilib", "utilkit", "helpers")
MODULES = ("mathkit", "textkit", "listkit", "numkit")


def _reference(name: str):
    namespace: dict = {}
    exec(POOL[name][2], namespace)  # our own reference source, never agent code
    return namespace[name]


@dataclasses.dataclass(frozen=True, kw_only=True)
class Options:
    """``--config.task.family_options.repo_spec.*``."""

    n_modules: int = 2  # modules of the package to write
    functions_per_module: int = 2
    case_timeout_s: float = 2.0  # per hidden unit case


@FAMILIES.register(FAMILY, config=Options, generated=True,
                   summary="write a small Python package to a README's spec; graded by hidden unit cases")
def make_task(seed: int, options: Options | None = None, **values) -> Task:
    o = family_options(FAMILY, options, values)
    n_modules, functions_per_module, case_timeout_s = o.n_modules, o.functions_per_module, o.case_timeout_s
    if not 1 <= n_modules <= len(MODULES):
        raise ValueError(f"repo_spec.make_task: n_modules must be in [1, {len(MODULES)}], got {n_modules}")
    if not 1 <= functions_per_module or n_modules * functions_per_module > len(POOL):
        raise ValueError(f"repo_spec.make_task: need 1 <= functions_per_module and n_modules * "
                         f"functions_per_module <= {len(POOL)}, got {n_modules} x {functions_per_module}")
    rng = random.Random(seed)
    pkg = rng.choice(PACKAGES)
    fns = rng.sample(sorted(POOL), n_modules * functions_per_module)
    modules = []
    for m, mod in enumerate(rng.sample(MODULES, n_modules)):
        functions = []
        for name in fns[m * functions_per_module:(m + 1) * functions_per_module]:
            sig, doc, _, cases = POOL[name]
            ref = _reference(name)
            functions.append({"name": name, "signature": sig, "doc": doc, "cases": [
                {"args": args, "expected": json.loads(json.dumps(ref(*args)))} for args in cases]})
        modules.append({"name": mod, "path": f"{pkg}/{mod}.py", "import": f"{pkg}.{mod}", "functions": functions})
    params = {"package": pkg, "modules": modules, "readme_words": [pkg] + [m["name"] for m in modules],
              "case_timeout_s": case_timeout_s}
    return Task(task_id=f"repo-{seed}-{n_modules}x{functions_per_module}", family=FAMILY, prompt=_prompt(params),
                grader="gyre_jax.agents.tasks.repo_spec:grade", params=params)


def _prompt(params: dict) -> str:
    pkg = params["package"]
    lines = [f"Build a small Python package `{pkg}` in the workspace (importable from the workspace root).",
             "Files:", f"- {pkg}/__init__.py (may be empty)"]
    for mod in params["modules"]:
        lines.append(f"- {mod['path']} defining:")
        for fn in mod["functions"]:
            ex = fn["cases"][0]
            call = f"{fn['name']}({', '.join(repr(a) for a in ex['args'])})"
            lines.append(f"  - {fn['signature']}: {fn['doc']} Example: {call} == {ex['expected']!r}")
    lines.append(f"- {README} mentioning {', '.join(params['readme_words'])}")
    lines.append("Hidden unit tests check every function. Call finish when done.")
    return "\n".join(lines)


def reference_files(task: Task) -> dict[str, str]:
    """A workspace that scores 1.0."""
    p = task.params
    files = {f"{p['package']}/__init__.py": ""}
    for mod in p["modules"]:
        files[mod["path"]] = "\n\n".join(POOL[fn["name"]][2] for fn in mod["functions"])
    files[README] = f"# {p['package']}\n\nModules: {', '.join(m['name'] for m in p['modules'])}.\n"
    return files


solution_files = reference_files  # what --check_tasks grades as the solution


def solution_turns(task: Task) -> list[list[tuple[str, dict]]]:
    """Look, write every file, check the imports, finish."""
    imports = ", ".join(m["import"] for m in task.params["modules"])
    return [[("list_files", {})],
            [("write_file", {"path": path, "content": content}) for path, content in reference_files(task).items()],
            [("run", {"command": f"python3 -c 'import {imports}; print(\"ok\")'"})],
            [("finish", {"message": "package written and imports checked"})]]


def grade(task: Task, workspace: Path) -> Grade:
    workspace = Path(workspace)
    p = task.params
    checks = Checks()
    timeout_s = float(p["case_timeout_s"])
    init = f"{p['package']}/__init__.py"
    checks.add(f"exists:{init}", (workspace / init).is_file())
    for mod in p["modules"]:
        present = checks.add(f"exists:{mod['path']}", (workspace / mod["path"]).is_file())
        names = [import_check_name(mod["import"])]
        for fn in mod["functions"]:
            defines, cases = check_names(mod["import"], fn["name"], len(fn["cases"]))
            names += [defines, *cases]
        results = run_module_checks(workspace, mod, timeout_s) if present else {}
        why = results.get("_why_missing", {}).get("note", "file missing")
        if names[0] in results and not results[names[0]]["ok"]:
            why = "the module did not import"
        expected = {name: case["expected"] for fn in mod["functions"]
                    for name, case in zip(check_names(mod["import"], fn["name"], len(fn["cases"]))[1], fn["cases"])}
        for name in names:
            r = results.get(name)
            if r is None:
                checks.add(name, False, f"no result ({why})")
            elif name in expected and r["ok"]:
                ok = "got" in r and same_json(r["got"], expected[name])
                checks.add(name, ok, "" if ok else f"expected {expected[name]!r}, got {r.get('got')!r}")
            else:
                checks.add(name, bool(r["ok"]), r["note"])
    readme = workspace / README
    text = readme.read_text(errors="replace").lower() if readme.is_file() else ""
    checks.add(f"exists:{README}", readme.is_file())
    for word in p["readme_words"]:
        checks.add(f"readme:{word}", word.lower() in text)
    return checks.grade()
