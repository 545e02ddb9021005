"""Hugging Face checkpoints in and out: Qwen2/Qwen2.5, Qwen3, Qwen3-MoE and Llama-3.

    from gyre_jax.model.hf import load_pretrained, save_pretrained
    cfg, params = load_pretrained("/ckpt/Qwen3-8B", mesh=mesh)  # params born sharded
    save_pretrained(params, cfg, "/out/policy", like="/ckpt/Qwen3-8B")  # servable by vLLM/SGLang

``config_map`` maps config.json onto ModelConfig (and back), ``tensors`` names and
reshapes each tensor, ``st_io`` streams safetensors files, ``checkpoint`` does the I/O.
"""
from gyre_jax.model.hf.checkpoint import TOKENIZER_FILES, load_pretrained, read_config, save_pretrained, vocab_multiple
from gyre_jax.model.hf.config_map import ARCHITECTURES, UnsupportedCheckpoint, config_from_hf, hf_config, source_dtype

__all__ = ["ARCHITECTURES", "TOKENIZER_FILES", "UnsupportedCheckpoint", "config_from_hf", "hf_config",
           "load_pretrained", "read_config", "save_pretrained", "source_dtype", "vocab_multiple"]
