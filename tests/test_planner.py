"""The memory planner (gyre_jax/planner.py): its parameter table is the model's, it refuses a layout
that cannot fit with one line naming the largest term, every shipped RL config fits the hardware
it names, and ``launch.main --plan`` answers before JAX starts a device."""
import functools
import glob
import json
import math
import os
import re
import runpy
import subprocess
import sys

import jax
import pytest

from gyre_jax import planner
from gyre_jax.errors import ConfigError
from gyre_jax.model import init_params, model_config_tiny
from launch import plan as launch_plan

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.parametrize("kw", [dict(), dict(qk_norm=True, qkv_bias=True, tie_embeddings=False, vocab_pad_multiple=3),
                                dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16, n_layers=3,
                                     mlp_only_layers=(1,))])
def test_param_table_matches_the_models_own_params(kw):
    m = model_config_tiny(**kw)
    abstract = jax.eval_shape(functools.partial(init_params, m), jax.random.key(0))
    want = sorted(math.prod(x.shape) for x in jax.tree.leaves(abstract))
    assert sorted(math.prod(s) for _, s, _ in planner.param_table(m)) == want


def _rl_configs():
    out = []
    for path in sorted(glob.glob(os.path.join(ROOT, "configs", "*.py"))):
        mod = runpy.run_path(path)
        if mod["get_config"]().job == "rl":
            out.append(os.path.basename(path))
    return out


@pytest.mark.parametrize("name", _rl_configs())
def test_every_shipped_rl_config_fits_the_hardware_it_names(name):
    path = os.path.join(ROOT, "configs", name)
    mod = runpy.run_path(path)
    for kind, n, overrides in mod.get("PLANNED_HARDWARE", [("cpu", None, {})]):  # CPU demos: this host
        config = mod["get_config"]()
        for dotted, value in overrides.items():
            section, field = dotted.split(".")
            config[section][field] = value
        p = planner.plan(launch_plan.plan_inputs(config, path), kind, n or config.num_cpu_devices)
        p.check()
        assert all(r.fits for r in p.roles), p.table()


def test_qwen3_8b_with_64_slots_of_32k_is_refused_naming_the_kv_cache():
    """The layout configs/qwen3_8b.py documented before the planner: 64 x 32K tokens of KV per engine."""
    path = os.path.join(ROOT, "configs", "qwen3_8b.py")
    config = runpy.run_path(path)["get_config"]()
    config.cells.max_slots = 64
    p = planner.plan(launch_plan.plan_inputs(config, path), "h100-80g", 8)
    serve = {r.role: r for r in p.roles}["serve"]
    assert serve.terms["kv_cache"] == 64 * 32768 * 36 * 8 * 128 * 2 * 2 // 4  # split over serve_tensor=4
    with pytest.raises(ConfigError, match=r"serve role .* largest term kv_cache = 72\.0 GiB: lower config\.cells"
                                          r"\.max_slots") as e:
        p.check()
    assert "\n" not in str(e.value)


def test_sharding_divides_each_term_as_the_rules_table_says():
    m = model_config_tiny(n_heads=4, n_kv_heads=2, d_ff=64)
    table = planner.param_table(m)
    whole = planner.per_device_bytes(table, {}, 4)
    # every matrix splits over fsdp x tensor; only the [layers, D] norms stay whole on the tensor axis
    assert planner.per_device_bytes(table, {"fsdp": 2, "tensor": 1}, 4) == whole // 2
    norms = sum(math.prod(s) * 4 for n, s, _ in table if "norm" in n)
    assert planner.per_device_bytes(table, {"data": 2, "tensor": 2}, 4) == (whole - norms) // 2 + norms
    # kv heads that the tensor degree does not divide are copied, not split (the engine's cache)
    assert planner.split(("kv_heads",), (2,), {"tensor": 4}, replicate_indivisible=True) == 1


def test_check_local_refuses_what_this_hosts_devices_cannot_hold():
    path = os.path.join(ROOT, "configs", "demo.py")
    config = runpy.run_path(path)["get_config"]()
    cfg = launch_plan.plan_inputs(config, path)
    assert planner.check_local(cfg, jax.devices()[:2]) is not None
    config.cells.max_slots = 1 << 22  # ~4M slots of 160 tokens: a KV cache larger than the host's RAM
    with pytest.raises(ConfigError, match="largest term kv_cache"):
        planner.check_local(launch_plan.plan_inputs(config, path), jax.devices()[:2])


def _launch(*args):
    return subprocess.run([sys.executable, "-m", "launch.main", *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=120)


def test_launch_plan_prints_the_table_and_exits_before_any_device_work():
    r = _launch("--config", "configs/qwen3_8b.py", "--plan=h100-80g:8")
    assert r.returncode == 0, r.stderr
    assert "kv_cache" in r.stdout and re.search(r"\n\s*serve\s", r.stdout)
    assert "launch: process" not in r.stdout  # the job's layout line: JAX never started
    r = _launch("--config", "configs/qwen3_8b.py", "--plan=h100-80g:8", "--config.cells.max_slots=64")
    assert r.returncode == 2
    assert r.stderr.strip().count("\n") == 0 and "largest term kv_cache" in r.stderr
    r = _launch("--config", "configs/qwen3_8b.py", "--plan=h100:8")
    assert r.returncode == 2 and "unknown device kind 'h100'" in r.stderr


def test_the_rl_job_refuses_a_layout_its_devices_cannot_hold(tmp_path):
    """The RL build plans its own (CPU) devices before it starts any engine or trainer."""
    r = _launch("--config", "configs/demo.py", "--config.cells.max_slots=4194304", "--workdir", str(tmp_path))
    assert r.returncode == 2, r.stderr[-2000:]
    assert r.stderr.strip().count("\n") == 0
    assert "memory plan: the serve role" in r.stderr and "largest term kv_cache" in r.stderr


def test_plan_starts_no_jax_backend():
    """The plan is arithmetic: after it, JAX has initialised no backend (checked in a fresh process)."""
    code = ("import runpy; from launch import plan; from jax._src import xla_bridge\n"
            "cfg = runpy.run_path('configs/qwen3_8b.py')['get_config']()\n"
            "plan.run(cfg, 'configs/qwen3_8b.py', 'h100-80g:8')\n"
            "assert not xla_bridge._backends, xla_bridge._backends\n")
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]


def test_plan_takes_the_shape_from_a_checkpoint(tmp_path):
    from gyre_jax.testing.tiny_hf_checkpoint import write_tiny_hf_checkpoint

    d = str(tmp_path / "ck")
    write_tiny_hf_checkpoint(d, "qwen3", vocab_size=97)
    path = os.path.join(ROOT, "configs", "qwen3_8b.py")
    config = runpy.run_path(path)["get_config"]()
    config.model.hf_path = d
    config.cells.serve_tensor = 2  # the tiny checkpoint's 2 kv heads
    cfg = launch_plan.plan_inputs(config, path)
    hf = json.load(open(os.path.join(d, "config.json")))
    assert (cfg.model.d_model, cfg.model.n_layers, cfg.model.vocab_size) == (
        hf["hidden_size"], hf["num_hidden_layers"], hf["vocab_size"])
    assert cfg.model.padded_vocab == 98  # padded for serve_tensor=2, as the run pads it


def test_a_device_kind_missing_from_the_table_is_planned_with_the_memory_it_reports():
    from gyre_jax.testing.fake_device import FakeDevice

    KIND = "NVIDIA Future 12GB"  # a GPU the table does not name
    path = os.path.join(ROOT, "configs", "qwen3_8b.py")
    cfg = launch_plan.plan_inputs(runpy.run_path(path)["get_config"](), path)
    assert planner.check_local(cfg, [FakeDevice(KIND, 200 << 30)] * 8).roles[0].device_bytes == 200 << 30
    with pytest.raises(ConfigError, match="per NVIDIA Future 12GB device"):
        planner.check_local(cfg, [FakeDevice(KIND, 12 << 30)] * 8)
    assert planner.check_local(cfg, [FakeDevice(KIND, None)] * 8) is None


def test_an_elastic_satellite_keeps_its_engine_while_it_trains():
    """Roles per scheduler mode: elastic satellites hold the engine's params and cache plus a training
    snapshot; colocate's one cell holds the core's state and the engine; async cells never switch."""
    path = os.path.join(ROOT, "configs", "qwen3_8b.py")
    config = runpy.run_path(path)["get_config"]()
    roles = {r.role: r.terms for r in planner.plan(launch_plan.plan_inputs(config, path), "h100-80g", 8).roles}
    assert set(roles) == {"core", "serve", "satellite"}
    sat, core, serve = roles["satellite"], roles["core"], roles["serve"]
    assert sat["kv_cache"] == serve["kv_cache"] and sat["serve_params"] == serve["params"]
    assert sat["gradients"] == core["params"] == core["gradients"] // 2 and "optimizer" not in sat
    config.scheduler.mode = "async"
    assert [r.role for r in planner.plan(launch_plan.plan_inputs(config, path), "h100-80g", 8).roles] == [
        "core", "serve"]
    config.scheduler.mode = "colocate"
    (both,) = planner.plan(launch_plan.plan_inputs(config, path), "h100-80g", 8).roles
    assert both.role == "core+serve" and both.terms["kv_cache"] == serve["kv_cache"] and both.terms["optimizer"]


@pytest.mark.parametrize("kw", [dict(), dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16, n_layers=3,
                                             mlp_only_layers=(1,))])
def test_lora_table_matches_the_models_own_adapters(kw):
    from gyre_jax.model import lora as L

    lora = L.LoraConfig(rank=3, num_adapters=2, targets=("q_proj", "o_proj", "up_proj", "down_proj"))
    m = model_config_tiny(lora=lora, **kw)
    one = jax.eval_shape(functools.partial(L.init_adapter, m), jax.random.key(0))
    want = sorted(math.prod(x.shape) for x in jax.tree.leaves(one)) * 2
    assert sorted(math.prod(s) for _, s, _ in planner.lora_table(m, lora)) == sorted(want)


def test_lora_plan_holds_adapters_not_optimizer_state_for_the_base():
    """--config.train.lora.rank=16 on Qwen3-8B: the core's optimizer and gradients are the adapters' (tens of
    MB), the frozen base is in bf16; the serving role keeps the base to merge each version into."""
    path = os.path.join(ROOT, "configs", "qwen3_8b.py")
    full = launch_plan.plan_inputs(runpy.run_path(path)["get_config"](), path)
    c = runpy.run_path(path)["get_config"]()
    c.train.lora.rank = 16
    cfg = launch_plan.plan_inputs(c, path)
    p_full = {r.role: r for r in planner.plan(full, "h100-80g", 64).roles}
    p_lora = {r.role: r for r in planner.plan(cfg, "h100-80g", 64).roles}
    core_full, core = p_full["core"].terms, p_lora["core"].terms
    assert core["optimizer"] == 2 * core["adapters"] and core["gradients"] == 2 * core["adapters"]
    # rank 16 on every projection: 0.5% of the weights (each A or B splits over one mesh axis, not two: 1.5% per device)
    assert core["adapters"] * 40 < core_full["params"]
    assert core["params"] * 2 == core_full["params"] * (2 if full.model.param_dtype == "bfloat16" else 1)
    assert p_lora["core"].used < p_full["core"].used / 2
    assert p_lora["serve"].terms["lora_base"] == p_lora["serve"].terms["params"]


def test_a_cpu_host_is_planned_whole_and_refused_before_it_starts():
    """CPU devices share one RAM: the plan adds every cell at its largest role, the eval's engine, the
    checkpoint's host copy and the process itself, and refuses (naming the largest part) when the host has
    less; the parts are the per-device terms added up, independently here."""
    path = os.path.join(ROOT, "configs", "demo.py")
    config = runpy.run_path(path)["get_config"]()
    config.eval.kind, config.eval.every = "episodes", 1
    cfg = launch_plan.plan_inputs(config, path)
    p = planner.plan(cfg, "cpu", 8)
    roles = {r.role: r.used for r in p.roles}
    n_cells, size = 8 // cfg.cells.cell_size, cfg.cells.cell_size
    assert p.host["cells"] == (roles["core"] + (n_cells - 1) * max(roles["serve"], roles["satellite"])) * size
    assert p.host["eval_engine"] == roles["serve"] * size
    params = sum(math.prod(s) for _, s, _ in planner.param_table(cfg.model)) * 4
    assert p.host["checkpoint_copy"] == 3 * params and p.host["process"] == planner.PROCESS_BYTES
    m, c = cfg.model, cfg.cells
    slot_kv = 2 * m.n_layers * c.max_len * m.n_kv_heads * m.head_dim * 4  # k and v, float32
    assert p.host["prefix_caches"] == n_cells * c.max_slots * slot_kv  # n_cells - 1 rollout engines + the eval's
    assert p.host_bytes == sum(p.host.values()) and "host: " in p.table()
    p.check()
    tight = planner.plan(cfg, "cpu", 8, host_limit=p.host_bytes - 1)
    with pytest.raises(ConfigError, match=r"this host's process needs .* largest part process .*shrink it by 0.0 GiB"):
        tight.check()
    config.eval.every = 0
    assert planner.plan(launch_plan.plan_inputs(config, path), "cpu", 8).host["eval_engine"] == 0
    assert planner.plan(cfg, "h100-80g", 8).host is None  # accelerators: their own memory, per device
