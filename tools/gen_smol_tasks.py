"""Generate short shell / text / tiny-Python tasks a 135M instruct model can partly solve (JSONL, dataset format).

    python tools/gen_smol_tasks.py                       # examples/tasks/smol_tasks.jsonl: 320 train + 64 eval
    python tools/gen_smol_tasks.py --train 500 --eval 100 --seed 1 --out /tmp/t.jsonl
    python tools/gen_smol_tasks.py --families write_word,create_file   # a subset of the families

Each task: one instruction line, a few files, a grader command that checks the workspace's files by exit
code (``test``, ``cmp``, ``grep``; agent code only ever runs in a child process of the grader command, never
imported into a checker; a grader never names a shipped file the solution deletes or renames: clean-tree
grading keeps such files out of the policy's reach; nor does a task ask for an empty directory: only files
reach the graded tree), and ``metadata.solution`` (a shell command that scores 1; the untouched workspace
scores 0: ``--check_tasks`` and tests/test_smol_tasks.py check both). Held-out tasks (``split: eval``) draw
their words, names and numbers from pools disjoint from the train tasks', so a policy cannot pass them by
remembering train answers. ``metadata.family`` names the family (the bench reports pass rates per family).

The family mix (``MIX``) was tuned on SmolLM2-135M-Instruct through configs/smol_agent.py's harness so that
the base model is neither always wrong nor always right (numbers: README "Real models").
"""
from __future__ import annotations

import json
import os
import random
import shlex

import benchkit

_WORDS = ("apple banana cherry grape lemon mango melon olive peach pear plum berry "
          "red blue green black white yellow orange purple silver golden "
          "cat dog fish bird horse mouse tiger lion bear wolf fox duck "
          "sun moon star rain snow wind cloud river lake ocean hill stone "
          "table chair door window house garden bread water music paper").split()
_NAMES = ("notes data info log list report draft todo items words names values result output input "
          "summary config record memo letter").split()


def _split_pool(pool, held_out: bool, every: int = 4):
    """Disjoint pools: every ``every``-th item is held out."""
    return [w for i, w in enumerate(pool) if (i % every == 0) == held_out]


class _Gen:
    def __init__(self, rng: random.Random, held_out: bool):
        self.rng = rng
        self.words = _split_pool(_WORDS, held_out)
        self.names = _split_pool(_NAMES, held_out)
        self.held_out = held_out

    def word(self):
        return self.rng.choice(self.words)

    def words_n(self, n):
        return self.rng.sample(self.words, n)

    def name(self, ext=".txt"):
        return self.rng.choice(self.names) + ext

    def number(self):
        # held-out numbers are odd, train numbers even: disjoint answers
        return 2 * self.rng.randint(1, 49) + (1 if self.held_out else 0)


def _q(s: str) -> str:
    return shlex.quote(s)


def write_word(g):
    w = g.word()
    return (f"Write the word {w} into the file answer.txt.", {},
            f"test \"$(tr -d ' \\n' < answer.txt)\" = {w}", f"echo {w} > answer.txt")


def create_file(g):
    n = g.name()
    return f"Create an empty file named {n}.", {}, f"test -f {n}", f"touch {n}"


def count_words(g):
    n = 2 * g.rng.randint(1, 4) + (1 if g.held_out else 0)  # held out: odd counts
    return ("Write the number of words in text.txt into the file count.txt.", {"text.txt": " ".join(
        g.rng.choice(g.words) for _ in range(n)) + "\n"}, f"test \"$(tr -d ' \\n' < count.txt)\" = {n}",
        "wc -w < text.txt > count.txt")


def delete_file(g):
    a, b = g.rng.sample(g.names, 2)
    files = {f"{a}.txt": g.word() + "\n", f"{b}.txt": g.word() + "\n"}
    # The graders name only what must remain: issue 42's clean-tree grading protects a shipped file its grader
    # command names, so a deletion of it would never reach the graded tree.
    return (f"Delete the file {a}.txt.", files, f"test \"$(ls)\" = {b}.txt", f"rm {a}.txt")


def copy_file(g):
    a, b = g.rng.sample(g.names, 2)
    w = g.word()
    return (f"Copy the file {a}.txt to {b}.txt.", {f"{a}.txt": w + "\n"},
            f"cmp -s {a}.txt {b}.txt && test \"$(cat {a}.txt)\" = {w}", f"cp {a}.txt {b}.txt")


def rename_file(g):
    a, b = g.rng.sample(g.names, 2)
    w = g.word()
    return (f"Rename the file {a}.txt to {b}.txt.", {f"{a}.txt": w + "\n"},
            f"test \"$(ls)\" = {b}.txt && test \"$(cat {b}.txt)\" = {w}", f"mv {a}.txt {b}.txt")


def sum_numbers(g):
    a, b = g.number(), 2 * g.rng.randint(1, 49)  # held out: odd sums, train: even
    return (f"Write the sum of {a} and {b} into the file answer.txt.", {},
            f"test \"$(tr -d ' \\n' < answer.txt)\" = {a + b}", f"echo $(({a} + {b})) > answer.txt")


def count_lines(g):
    n = 2 * g.rng.randint(1, 4) + (1 if g.held_out else 0)  # held out: odd counts
    body = "".join(w + "\n" for w in (g.word() for _ in range(n)))
    return ("Write the number of lines in data.txt into the file count.txt.", {"data.txt": body},
            f"test \"$(tr -d ' \\n' < count.txt)\" = {n}", "wc -l < data.txt > count.txt")


def upper_case(g):
    ws = g.words_n(3)
    text = " ".join(ws)
    return ("Write the text of input.txt in upper case into the file output.txt.", {"input.txt": text + "\n"},
            f"test \"$(cat output.txt)\" = {_q(text.upper())}", "tr a-z A-Z < input.txt > output.txt")


def sort_lines(g):
    ws = g.words_n(4)
    return ("Sort the lines of words.txt alphabetically and write them into the file sorted.txt.",
            {"words.txt": "".join(w + "\n" for w in ws)},
            f"test \"$(cat sorted.txt)\" = {_q(chr(10).join(sorted(ws)))}", "sort words.txt > sorted.txt")


def append_line(g):
    a, b = g.words_n(2)
    return (f"Append a line with the word {b} to the end of notes.txt.", {"notes.txt": a + "\n"},
            f"test \"$(cat notes.txt)\" = {_q(a + chr(10) + b)}", f"echo {b} >> notes.txt")


def first_line(g):
    ws = g.words_n(3)
    return ("Write the first line of data.txt into the file first.txt.", {"data.txt": "".join(w + "\n" for w in ws)},
            f"test \"$(cat first.txt)\" = {ws[0]}", "head -n 1 data.txt > first.txt")


def py_print(g):
    w, n = g.word(), g.rng.choice(g.names)
    return (f"Write a Python script {n}.py that prints the word {w}.", {},
            f"test \"$(timeout 10 python3 -P {n}.py 2>/dev/null)\" = {w}", f"echo 'print(\"{w}\")' > {n}.py")


def py_add(g):
    n = g.rng.choice(g.names)
    a, b = g.number(), 2 * g.rng.randint(1, 49)
    call = f"from {n} import add; print(add({a}, {b}))"
    return (f"In {n}.py, write a Python function add(a, b) that returns a + b.", {},
            f"test \"$(PYTHONPATH=. timeout 10 python3 -c {_q(call)} 2>/dev/null)\" = {a + b}",
            f"printf 'def add(a, b):\\n    return a + b\\n' > {n}.py")


FAMILIES = {f.__name__: f for f in (write_word, create_file, count_words, delete_file, copy_file, rename_file,
                                    sum_numbers, count_lines, upper_case, sort_lines, append_line, first_line,
                                    py_print, py_add)}
# Relative weights of the families in the generated set (tuned: see the module docstring).
MIX = {name: 1 for name in FAMILIES}


def generate(n_train: int, n_eval: int, seed: int = 0, families=None) -> list[dict]:
    names = list(families or FAMILIES)
    weights = [MIX.get(n, 1) for n in names]
    out = []
    for split, count, held_out in (("train", n_train, False), ("eval", n_eval, True)):
        rng = random.Random(f"{seed}:{split}")
        g = _Gen(rng, held_out)
        for i in range(count):
            # eval cycles through the families (equal counts: a per-family pass rate means something)
            fam = names[i % len(names)] if held_out else rng.choices(names, weights)[0]
            instruction, files, grader, solution = FAMILIES[fam](g)
            task = {"id": f"smol-{split}-{i:04d}-{fam}", "instruction": instruction, "grader": grader,
                    "split": split, "timeout_s": 120,
                    "metadata": {"solution": solution, "family": fam}}
            if files:
                task["files"] = files
            out.append(task)
    return out


def main():
    here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    ap = benchkit.tool_parser(__file__, __doc__)
    ap.add_argument("--train", type=int, default=320)
    ap.add_argument("--eval", type=int, default=64)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--families", default="", help=f"comma-separated subset of {sorted(FAMILIES)}")
    ap.add_argument("--out", default=os.path.join(here, "examples", "tasks", "smol_tasks.jsonl"))
    args = ap.parse_args()
    fams = [f for f in args.families.split(",") if f]
    unknown = sorted(set(fams) - set(FAMILIES))
    if unknown:
        ap.error(f"--families: unknown {unknown}; known: {sorted(FAMILIES)}")
    tasks = generate(args.train, args.eval, args.seed, fams or None)
    with open(args.out, "w") as f:
        for t in tasks:
            f.write(json.dumps(t) + "\n")
    print(f"wrote {len(tasks)} tasks ({args.train} train, {args.eval} eval) to {args.out}")


if __name__ == "__main__":
    main()
