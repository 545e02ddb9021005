"""The shape of the code, checked by reading it (``ast``), so it stays the way issue 31 left it.

* No function in ``gyre_jax/`` is longer than 60 lines (docstring included): code is read by
  people, one function at a time. ``LONG_FUNCTIONS_OWNED_ELSEWHERE`` lists the files still being
  split on other branches (issue 43); an entry with no long function left fails, so the list only
  shrinks. ``gyre_jax/rl/`` has its own test (it was first).
* Nothing reads another object's ``_private`` attributes (``x._name`` where ``x`` is not
  ``self``/``cls``/``super()``): an object's privates are its own business, so a class can change
  them without breaking a reader elsewhere. The whole package is clean (the last readers, the
  simulator and the remote engine's stream, got public methods); only other libraries' names are allowed.
* Construction never starts threads: ``TrainerAdapter``'s and ``LoopThread``'s constructors do not; ``start()`` does.
* No package cycle: the graph of which ``gyre_jax`` package imports which (every import statement,
  also those inside functions) has no cycle, so each package can be read and tested with only those
  below it (tests/test_package_layers.py pins the named layers; this catches any new loop).
* One registry type (issue 43): every extension point is a ``gyre_jax.registry.Registry``, and no module
  keeps a registry of its own (a module-level dict that a function fills by name).
* Config files list only overrides: an RL config starts from ``rl_config()`` or another config file
  (``load_config``), builds no section of its own, and sets no field to the value it already has.
* No module cycle either: the same graph between modules (every import statement, inside functions
  and under ``TYPE_CHECKING`` too: a cycle hidden from the interpreter is still one for a reader).
  ``MODULE_CYCLES_OWNED_ELSEWHERE`` lists the cycles other branches are removing (issue 43); like
  the long functions' list, it may only shrink.
"""
from __future__ import annotations

import ast
import functools
import os

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PKG = os.path.join(ROOT, "gyre_jax")
MAX_LINES = 60
# Folders (or files) whose long functions other branches are splitting now (issue 43): the integrator empties this.
LONG_FUNCTIONS_OWNED_ELSEWHERE: dict[str, str] = {}
# Module cycles other branches are removing (issue 43), each as its sorted modules.
MODULE_CYCLES_OWNED_ELSEWHERE = {
    ("model.attention", "model.config", "model.layers", "model.lora", "model.moe", "model.transformer"):
        "branch lora (lora.init_adapter_boxed imports the Transformer whose layers import lora)",
}
# Other libraries' private names we use: allowed anywhere (not ours to change).
THIRD_PARTY = {
    "os._exit",  # exit without running cleanup (after a fork; the fault injector's kill)
    "site._server",  # aiohttp: a started site's server, for the port it bound
    "fn._cache_size",  # jax: a jitted function's compile count
    "bound._cache_size", "jitted._cache_size",  # the same, on cells/train_step.py's bound steps
    "self._driver._generate_slots",  # JetStream: the driver's free-slot queue per engine
    # pytest's assertion rewriter: gyre's verdict plugin compiles the task's tests from memory
    "rewrite._rewrite_test", "rewrite._read_pyc",
    "sys._getframe",  # the verdict plugin reads a passing assert's operands from the rewritten test frame
    # jax's persistent compilation cache, keyed without the devices on CPU (compile_cache.py: one program per
    # shape for every cell; falls back to jax's own behaviour, logged, when these change)
    "cache_key._hash_serialized_compile_options", "compiler._cache_read", "compiler._compile_and_write_cache",
}


@functools.cache
def _modules() -> tuple[tuple[str, ast.AST], ...]:
    """(path under gyre_jax/, its syntax tree) of every module, parsed once for all the checks."""
    out = []
    for d, _, files in os.walk(PKG):
        for f in sorted(files):
            if f.endswith(".py"):
                path = os.path.join(d, f)
                with open(path) as fh:
                    out.append((os.path.relpath(path, PKG), ast.parse(fh.read(), path)))
    return tuple(out)


def long_functions(tree: ast.AST) -> list[tuple[str, int]]:
    return [(n.name, n.end_lineno - n.lineno + 1) for n in ast.walk(tree)
            if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)) and n.end_lineno - n.lineno + 1 > MAX_LINES]


def private_reads(tree: ast.AST) -> set[str]:
    out = set()
    for n in ast.walk(tree):
        if not (isinstance(n, ast.Attribute) and n.attr.startswith("_") and not n.attr.startswith("__")):
            continue
        v = n.value
        if isinstance(v, ast.Name) and v.id in ("self", "cls"):
            continue
        if isinstance(v, ast.Call) and isinstance(v.func, ast.Name) and v.func.id == "super":
            continue
        out.add(ast.unparse(n))
    return out


def test_no_function_in_rl_is_longer_than_60_lines():
    offenders = [f"gyre_jax/{path}:{name} ({n} lines)" for path, tree in _modules() if path.startswith("rl/")
                 for name, n in long_functions(tree)]
    assert not offenders, f"functions over {MAX_LINES} lines: {offenders}"


def test_no_function_in_gyre_jax_is_longer_than_60_lines():
    long = {path: found for path, tree in _modules() if (found := long_functions(tree))}
    owned = tuple(LONG_FUNCTIONS_OWNED_ELSEWHERE)
    offenders = [f"gyre_jax/{path}:{name} ({n} lines)" for path, found in sorted(long.items())
                 if not path.startswith(owned) for name, n in found]
    assert not offenders, f"functions over {MAX_LINES} lines (split them into named steps): {offenders}"
    stale = sorted(p for p in owned if not any(path.startswith(p) for path in long))
    assert not stale, f"no long function left in {stale}: remove them from LONG_FUNCTIONS_OWNED_ELSEWHERE"


def test_nothing_reads_another_objects_privates():
    reads = [f"gyre_jax/{path}: {r}" for path, tree in _modules() for r in sorted(private_reads(tree) - THIRD_PARTY)]
    assert not reads, f"reads of another object's private attributes (add a public method): {reads}"


def package_imports() -> dict[str, dict[str, str]]:
    """package -> {imported gyre_jax package: the first module of it that imports it} (a top-level
    module such as ``sharding.py`` is its own package)."""
    out: dict[str, dict[str, str]] = {}
    for path, tree in _modules():
        pkg = path.split(os.sep)[0].removesuffix(".py")
        for n in ast.walk(tree):
            names = [a.name for a in n.names] if isinstance(n, ast.Import) else \
                [f"{n.module}.{a.name}" for a in n.names] if isinstance(n, ast.ImportFrom) and n.module and n.level == 0 \
                else []
            for name in names:
                parts = name.split(".")
                if parts[0] == "gyre_jax" and len(parts) > 1 and parts[1] != pkg:
                    out.setdefault(pkg, {}).setdefault(parts[1], f"gyre_jax/{path}")
    return out


def find_cycle(graph: dict[str, dict[str, str]]) -> list[str]:
    """One cycle of the graph as [a, b, ..., a], or []."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(v: str) -> list[str]:
        state[v] = 1
        path.append(v)
        for w in sorted(graph.get(v, {})):
            if state.get(w) == 1:
                return path[path.index(w):] + [w]
            if w not in state and (c := visit(w)):
                return c
        state[v] = 2
        path.pop()
        return []

    for v in sorted(graph):
        if v not in state and (c := visit(v)):
            return c
    return []


def test_no_package_cycle():
    graph = package_imports()
    assert {"model", "cells", "rl"} <= set(graph), sorted(graph)  # the reader sees the packages
    cycle = find_cycle(graph)
    assert not cycle, "package cycle " + " -> ".join(cycle) + ": " + "; ".join(
        f"{a} -> {b} in {graph[a][b]}" for a, b in zip(cycle, cycle[1:]))


def module_imports() -> dict[str, set[str]]:
    """module -> the gyre_jax modules it imports (dotted, without 'gyre_jax.'; a package is its
    ``__init__``). ``from gyre_jax.p import x`` names module ``p.x`` when that is a module, else ``p``;
    relative imports are resolved; imports in functions and under TYPE_CHECKING count."""
    mods = {path[:-3].replace(os.sep, ".").removesuffix(".__init__"): path for path, _ in _modules()}

    def owner(name: str) -> str | None:  # the module that defines a dotted name
        while name and name not in mods:
            name = name.rpartition(".")[0]
        return name or None

    out: dict[str, set[str]] = {}
    for path, tree in _modules():
        me = path[:-3].replace(os.sep, ".").removesuffix(".__init__")
        package = me if path.endswith("__init__.py") else me.rpartition(".")[0]
        deps: set[str] = set()
        for n in ast.walk(tree):
            if isinstance(n, ast.Import):
                deps |= {owner(a.name[len("gyre_jax."):]) for a in n.names if a.name.startswith("gyre_jax.")}
            elif isinstance(n, ast.ImportFrom):
                if n.level:
                    base = ".".join(package.split(".")[: len(package.split(".")) - n.level + 1] if package else [])
                    full = ".".join(x for x in (base, n.module) if x)
                elif n.module and n.module.startswith("gyre_jax"):
                    full = n.module[len("gyre_jax."):] if n.module != "gyre_jax" else ""
                else:
                    continue
                deps |= {f"{full}.{a.name}".lstrip(".") if f"{full}.{a.name}".lstrip(".") in mods else owner(full)
                         for a in n.names}
        out[me] = {d for d in deps if d and d != me}
    return out


def module_cycles(graph: dict[str, set[str]]) -> list[tuple[str, ...]]:
    """The graph's cycles, one per strongly connected component of more than one module (Tarjan), sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    out: list[tuple[str, ...]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while (w := stack.pop()) != v:
                comp.append(w)
            if comp:
                out.append(tuple(sorted(comp + [v])))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return sorted(out)


def test_no_module_cycle():
    cycles = module_cycles(module_imports())
    new = [c for c in cycles if c not in MODULE_CYCLES_OWNED_ELSEWHERE]
    assert not new, "module import cycles (TYPE_CHECKING and function-level imports count): " + "; ".join(
        " <-> ".join(c) for c in new)
    stale = [c for c in MODULE_CYCLES_OWNED_ELSEWHERE if c not in cycles]
    assert not stale, f"cycles gone: remove {stale} from MODULE_CYCLES_OWNED_ELSEWHERE"


def test_the_checks_see_what_they_look_for():
    """The two readers find a long function and a private read in a snippet (the checks can fail)."""
    body = "\n".join(f"    x{i} = {i}" for i in range(MAX_LINES))
    assert long_functions(ast.parse(f"def f():\n{body}\n")) == [("f", MAX_LINES + 1)]
    assert private_reads(ast.parse("a = b._c + self._d + super()._e + cls._f + o.__len__")) == {"b._c"}
    assert find_cycle({"a": {"b": ""}, "b": {"c": ""}, "c": {"a": ""}, "d": {"a": ""}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b": ""}, "b": {"c": ""}, "d": {"a": "", "c": ""}}) == []
    assert module_cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a", "e"}, "e": {"d"}}) == [
        ("a", "b", "c"), ("d", "e")]
    assert module_cycles({"a": {"b"}, "b": {"c"}, "d": {"a", "c"}}) == []
    graph = module_imports()  # the reader resolves absolute, relative, function-level and TYPE_CHECKING imports
    assert "model.attend" in graph["model.attention"] and "serving.tokenizer_base" in graph["serving.hf_tokenizer"]
    assert "serving.hf_tokenizer" in graph["serving.tokenizer"]  # inside load_tokenizer


def test_constructing_the_trainer_adapter_or_the_harness_loop_starts_no_thread():
    """Their constructors start nothing; ``start()`` starts their threads; ``stop()`` ends them."""
    import threading
    import types

    import numpy as np

    from gyre_jax.rl.group_queue import GroupQueue
    from gyre_jax.rl.groups import WorkEstimate
    from gyre_jax.rl.runtime import LoopThread
    from gyre_jax.rl.step_processor import StepProcessor
    from gyre_jax.rl.step_runner import StepRunner
    from gyre_jax.rl.trainer import TrainerAdapter
    from gyre_jax.trajectory.dataset import RowStream, StreamingDataset

    stream = RowStream(8)
    core = types.SimpleNamespace(version=0, state=types.SimpleNamespace(params={"w": np.zeros(2, np.float32)}))
    before = set(threading.enumerate())
    store = types.SimpleNamespace(consumed=dict)
    processor = StepProcessor(store=store, config=None, stream=stream, micro_batch_rows=1, group_size=1)
    queue = GroupQueue(store=store, advantage=None, groups_per_step=1, stream_groups=False, send=processor.inbox.put,
                       notify=lambda: None, work=WorkEstimate(0.1))
    runner = StepRunner(trainer=core, store=store, iterator=iter(StreamingDataset(stream, batch_size=1, seed=0)),
                        inputs=processor.outbox, micro_batch_rows=1, groups_per_step=1, cells=[], cell_roles=list,
                        work=WorkEstimate(0.1))
    adapter = TrainerAdapter(queue, processor, runner)
    harness_loop = LoopThread()
    assert set(threading.enumerate()) == before
    adapter.start()
    harness_loop.start()
    started = {t.name for t in set(threading.enumerate()) - before}
    assert {"gyre-processor", "gyre-trainer", "gyre-harness"} <= started, started
    adapter.stop()
    harness_loop.stop()
    assert not [t for t in threading.enumerate() if t.name in ("gyre-processor", "gyre-trainer", "gyre-harness")]


# ------------------------------------------------------------------ issue 43: one registry, one schema, hooks
def test_every_extension_point_is_the_one_registry_type():
    from gyre_jax.agents.task_sources import TASK_SOURCES
    from gyre_jax.plugins import all_registries
    from gyre_jax.registry import Registry

    regs = {**all_registries(), "task": TASK_SOURCES}
    assert {"train.loss", "train.advantage", "train.mismatch", "train.weights", "harness.kind", "task.family",
            "task.dataset_options.format", "metrics.sinks", "scheduler.mode", "job"} <= set(regs)
    for flag, reg in regs.items():
        assert isinstance(reg, Registry), (flag, type(reg))
        assert reg.names(), flag
        try:
            reg.get("no_such_entry")
        except LookupError as e:  # the same error everywhere: what kind, and the known names
            assert str(e) == f"unknown {reg.kind} 'no_such_entry'; known: {reg.names()}"
        else:
            raise AssertionError(flag)


def home_made_registries(tree: ast.AST) -> list[str]:
    """Module-level ALL_CAPS dicts that start empty and that a function fills by key: registries of their own."""
    empty = {t.id for n in getattr(tree, "body", []) if isinstance(n, (ast.Assign, ast.AnnAssign))
             for t in (n.targets if isinstance(n, ast.Assign) else [n.target])
             if isinstance(t, ast.Name) and t.id.lstrip("_").isupper() and n.value is not None
             and (isinstance(n.value, ast.Dict) and not n.value.keys
                  or isinstance(n.value, ast.Call) and ast.unparse(n.value.func) == "dict" and not n.value.args)}
    filled = {t.value.id for f in ast.walk(tree) if isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef))
              for n in ast.walk(f) if isinstance(n, ast.Assign) for t in n.targets
              if isinstance(t, ast.Subscript) and isinstance(t.value, ast.Name)}
    return sorted(empty & filled)


def test_no_module_keeps_a_registry_of_its_own():
    own = [f"gyre_jax/{path}: {name}" for path, tree in _modules() for name in home_made_registries(tree)]
    allowed = {"gyre_jax/losses/registry.py: METRIC_REDUCTIONS",  # a metric -> reduction table, not a registry
               # the pytest plugin's caches of the graded test files' sources (path -> text), not registries
               "gyre_jax/agents/verdict_plugin.py: _LINES", "gyre_jax/agents/verdict_plugin.py: _SOURCES"}
    assert not set(own) - allowed, sorted(set(own) - allowed)
    assert home_made_registries(ast.parse("_R = {}\ndef register(k, v):\n    _R[k] = v\n")) == ["_R"]


def _assignments(fn: ast.FunctionDef) -> tuple[str, list[tuple[list[str], object, int]]]:
    """(what the config starts from, [(dotted path, literal value, line)]) of a config file's get_config."""
    aliases: dict[str, list[str]] = {}
    out: list = []
    base = next((ast.unparse(n) for n in ast.walk(fn) if isinstance(n, ast.Call)
                 and ast.unparse(n.func) in ("rl_config", "load_config")), "")

    def path_of(node):
        parts = []
        while isinstance(node, (ast.Attribute, ast.Subscript)):
            if isinstance(node, ast.Attribute):
                parts.append(node.attr)
            elif isinstance(node.slice, ast.Constant):
                parts.append(node.slice.value)
            else:
                return None
            node = node.value
        return aliases[node.id] + parts[::-1] if isinstance(node, ast.Name) and node.id in aliases else None

    for n in ast.walk(fn):
        if not isinstance(n, ast.Assign) or len(n.targets) != 1:
            continue
        t, v = n.targets[0], n.value
        if isinstance(t, ast.Name) and isinstance(v, ast.Call) and ast.unparse(v.func) in ("rl_config", "load_config"):
            aliases[t.id] = []
        elif isinstance(t, ast.Name) and path_of(v) is not None:
            aliases[t.id] = path_of(v)
        elif path_of(t) is not None:
            try:
                out.append((path_of(t), ast.literal_eval(v), n.lineno))
            except ValueError:
                out.append((path_of(t), v, n.lineno))
    return base, out


def restated_defaults(source: str, name: str) -> list[str]:
    """What a config file's get_config does against "overrides only": builds a config itself, builds a whole
    section, or sets a field to the value its base (``rl_config()``) already has."""
    from gyre_jax.rl.config import rl_config

    fn = next(n for n in ast.parse(source).body if isinstance(n, ast.FunctionDef) and n.name == "get_config")
    base_call, assigned = _assignments(fn)
    if not base_call:
        return [f"configs/{name} builds its config itself: start from rl_config() or load_config(...)"]
    if not base_call.startswith("rl_config"):
        return []  # a config of another's (its base is that file, checked there)
    base, out = rl_config(), []
    for dotted, value, line in assigned:
        if isinstance(value, ast.AST):
            if len(dotted) == 1 and "ConfigDict" in ast.unparse(value):
                out.append(f"configs/{name}:{line}: config.{dotted[0]} is a section of its own: set its fields")
            continue
        node = base
        for part in dotted:
            node = node[part]
        if node == value:
            out.append(f"configs/{name}:{line}: config.{'.'.join(map(str, dotted))} = {value!r} is the default")
    return out


def test_config_files_list_only_overrides():
    import glob
    import runpy

    checked = 0
    for path in sorted(glob.glob(os.path.join(ROOT, "configs", "*.py"))):
        if runpy.run_path(path)["get_config"]().job != "rl":
            continue
        with open(path) as f:
            bad = restated_defaults(f.read(), os.path.basename(path))
        assert not bad, bad
        checked += 1
    assert checked >= 6
    toy = "from gyre_jax.rl.config import rl_config\ndef get_config():\n    c = rl_config()\n    h = c.harness\n" \
          "    h.max_turns = 1\n    c.steps = 3\n    return c\n"
    assert restated_defaults(toy, "toy.py") == ["configs/toy.py:5: config.harness.max_turns = 1 is the default"]
