"""LoRA adapters as PEFT directories (model/hf/peft.py): our export reads back exactly; the file is in
PEFT's layout (names, [out, in] shapes, B @ A update); refusals name what is not covered; and (slow,
optional) ``peft`` itself loads our export on the transformers base and gives our logits.

The slow test runs in a Python with torch, transformers and peft (``GYRE_TORCH_PYTHON``, default
/work/torchvenv/bin/python: ``pip install torch transformers safetensors peft``), skipped without one.

    GYRE_TORCH_PYTHON=/work/torchvenv/bin/python pytest -m slow tests/test_lora_peft.py
"""
import json
import os
import subprocess

import jax
import numpy as np
import pytest

from gyre_jax.model import lora as L
from gyre_jax.model.hf import load_pretrained
from gyre_jax.model.hf.peft import CONFIG_FILE, WEIGHTS_FILE, load_peft, save_peft
from gyre_jax.model.hf.st_io import SafetensorsReader
from gyre_jax.testing.tiny_hf_checkpoint import write_tiny_hf_checkpoint
from tests.test_lora import _random_adapter

TORCH_PY = os.environ.get("GYRE_TORCH_PYTHON", "/work/torchvenv/bin/python")


def _model(tmp_path, family="qwen3", lora=None, **over):
    src = str(tmp_path / "base")
    write_tiny_hf_checkpoint(src, family, seed=5, **over)
    cfg, base = load_pretrained(src)
    return src, cfg.replace(lora=lora or L.LoraConfig(rank=4, alpha=8.0, layers=(1,))), base


def test_peft_round_trip_and_layout(tmp_path):
    src, cfg, _ = _model(tmp_path)
    ad = _random_adapter(cfg, 3)
    out = save_peft(cfg, ad, str(tmp_path / "adapter"), base_model=src)
    with open(os.path.join(out, CONFIG_FILE)) as f:
        c = json.load(f)
    assert (c["peft_type"], c["r"], c["lora_alpha"], c["layers_to_transform"]) == ("LORA", 4, 8.0, [1])
    with SafetensorsReader(os.path.join(out, WEIGHTS_FILE)) as rd:
        names = set(rd.tensors)
        q_a = rd.read("base_model.model.model.layers.1.self_attn.q_proj.lora_A.weight")
        q_b = rd.read("base_model.model.model.layers.1.self_attn.q_proj.lora_B.weight")
    assert len(names) == 2 * 7 and not any(".layers.0." in n for n in names)  # layer 0 carries none
    # PEFT's update B @ A ([out, in]) is our A @ B transposed: the HF q weight's delta
    a = np.asarray(ad["lora"]["layers"]["attn"]["q_lora_a"][1]).reshape(cfg.d_model, -1)
    b = np.asarray(ad["lora"]["layers"]["attn"]["q_lora_b"][1]).reshape(4, -1)
    np.testing.assert_allclose(q_b @ q_a, (a @ b).T, rtol=1e-6, atol=1e-6)
    lora, back = load_peft(out, cfg)
    assert lora == cfg.lora
    want = jax.device_get(ad)
    for (path, x), y in zip(jax.tree_util.tree_leaves_with_path(back), jax.tree.leaves(want)):
        keep = np.asarray(y)[1]  # the selected layer exactly; the other is zeros (scale 0: never applied)
        assert np.array_equal(np.asarray(x)[1], keep), jax.tree_util.keystr(path)
        assert not np.any(np.asarray(x)[0])


def test_peft_refusals(tmp_path):
    src, cfg, _ = _model(tmp_path)
    out = save_peft(cfg, _random_adapter(cfg, 1), str(tmp_path / "a"))
    with pytest.raises(ValueError, match="rank: run 8 vs file 4"):
        load_peft(out, cfg.replace(lora=L.LoraConfig(rank=8, alpha=16.0, layers=(1,))))
    with open(os.path.join(out, CONFIG_FILE)) as f:
        c = json.load(f)
    c["use_dora"] = True
    with open(os.path.join(out, CONFIG_FILE), "w") as f:
        json.dump(c, f)
    with pytest.raises(ValueError, match="use_dora=True is not covered"):
        load_peft(out, cfg)
    moe_src = str(tmp_path / "moe")
    write_tiny_hf_checkpoint(moe_src, "qwen3_moe", seed=1)
    mcfg, _ = load_pretrained(moe_src)
    with pytest.raises(ValueError, match="MoE experts are not covered"):
        save_peft(mcfg.replace(lora=L.LoraConfig(rank=2)), None, str(tmp_path / "m"))


PEFT_SCRIPT = """
import json, sys
import numpy as np, torch
from transformers import AutoModelForCausalLM
from peft import PeftModel
base = AutoModelForCausalLM.from_pretrained(sys.argv[1], dtype=torch.float32).eval()
m = PeftModel.from_pretrained(base, sys.argv[2]).eval()
ids = json.loads(sys.argv[3])
with torch.no_grad():
    out = m(input_ids=torch.tensor([ids])).logits[0]
np.save(sys.argv[4], out.double().numpy())
"""


def _peft_ok() -> bool:
    try:
        r = subprocess.run([TORCH_PY, "-c", "import torch, transformers, peft"], capture_output=True, timeout=120)
    except (OSError, subprocess.TimeoutExpired):
        return False
    return r.returncode == 0


@pytest.mark.slow
@pytest.mark.parametrize("family,lora", [
    ("qwen3", L.LoraConfig(rank=4, alpha=8.0)),
    ("llama3", L.LoraConfig(rank=2, alpha=5.0, layers=(0,), targets=("q_proj", "v_proj", "down_proj"), rslora=True)),
])
def test_peft_loads_our_adapter_and_gives_our_logits(tmp_path, family, lora):
    if not _peft_ok():
        pytest.skip(f"{TORCH_PY} cannot import torch, transformers and peft (set GYRE_TORCH_PYTHON)")
    from gyre_jax.model import Transformer

    src, cfg, base = _model(tmp_path, family, lora, **({"hidden_size": 64} if family == "llama3" else {}))
    ad = _random_adapter(cfg, 7)
    out = save_peft(cfg, ad, str(tmp_path / "adapter"), base_model=src)
    ids = [int(x) for x in np.random.default_rng(2).integers(0, cfg.vocab_size, 12)]
    n = len(ids)
    row = lambda a: np.asarray(a, np.int32)[None]  # noqa: E731
    ours = jax.jit(Transformer(cfg).apply)(L.variables(cfg, base, (ad,)), row(ids), row(np.arange(n)), row(np.ones(n)),
                                           row(np.full(n, n)))
    npy = str(tmp_path / "logits.npy")
    subprocess.run([TORCH_PY, "-c", PEFT_SCRIPT, src, out, json.dumps(ids), npy], check=True, timeout=900,
                   env={**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"})
    theirs = np.load(npy)
    got = np.asarray(ours)[0, :, :cfg.vocab_size]
    assert np.max(np.abs(got - np.asarray(jax.jit(Transformer(cfg.replace(lora=None)).apply)(
        base, row(ids), row(np.arange(n)), row(np.ones(n)), row(np.full(n, n))))[0, :, :cfg.vocab_size])) > 1e-2
    np.testing.assert_allclose(got, theirs, atol=1e-4, rtol=1e-4)


def test_a_run_starts_from_a_peft_adapter(tmp_path):
    """config.train.lora.init_from: a fresh LoRA run's adapters are the directory's (every adapter slot), and an
    adapter of another rank is refused naming the field."""
    from configs import demo as demo_config
    from gyre_jax.errors import ConfigError
    from gyre_jax.rl import lora_run
    from gyre_jax.rl.config import RLConfig

    c = demo_config.get_config()
    c.train.lora.update(dict(rank=4, alpha=8.0, layers="1"))
    cfg = RLConfig.from_config(c)
    ad = _random_adapter(cfg.policy_model, 4)
    src = save_peft(cfg.policy_model, ad, str(tmp_path / "start"))
    c.train.lora.init_from = src
    got = lora_run.initial_adapters(RLConfig.from_config(c), seed=0)
    assert len(got) == 1
    for x, y in zip(jax.tree.leaves(got[0]), jax.tree.leaves(jax.device_get(ad))):
        assert np.array_equal(np.asarray(x)[1], np.asarray(y)[1])
    c.train.lora.rank = 8
    with pytest.raises(ConfigError, match="config.train.lora.init_from=.*rank: run 8 vs file 4"):
        lora_run.initial_adapters(RLConfig.from_config(c), seed=0)
