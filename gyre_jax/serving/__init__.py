"""gyre_jax.serving: the JetStream engine, the backend interface, routing with
drain / re-route, and the recording proxy that real harnesses talk to.

    engine.GyreEngine            our model as a jetstream.engine_api.Engine
    jetstream_backend            a cell = GyreEngine under JetStream's orchestrator Driver
    backend.Backend              submit / stream / cancel / export (+ import via submit)
    router.Router                least-loaded with rollout affinity; drain(cell), admit(cell)
    proxy.Proxy                  OpenAI + Anthropic HTTP APIs; one record per call
    tokenizer                    built-in byte tokenizer + chat template; user tokenizer files
    server_thread.ServerThread   run it all on a background event loop

Names are imported lazily: ``import gyre_jax.serving`` stays cheap, and only the
engine modules import JetStream (and through it tensorflow), via
``jetstream_compat``.
"""
import importlib

_EXPORTS = {
    "GyreEngine": "gyre_jax.serving.engine",
    "JetStreamBackend": "gyre_jax.serving.jetstream_backend",
    "Backend": "gyre_jax.serving.backend",
    "EngineError": "gyre_jax.serving.backend",
    "GenerateRequest": "gyre_jax.serving.backend",
    "ResumeState": "gyre_jax.serving.backend",
    "SamplingParams": "gyre_jax.serving.backend",
    "TokenEvent": "gyre_jax.serving.backend",
    "Router": "gyre_jax.serving.router",
    "Proxy": "gyre_jax.serving.proxy",
    "ProxyConfig": "gyre_jax.serving.proxy",
    "ServerThread": "gyre_jax.serving.server_thread",
    "ByteTokenizer": "gyre_jax.serving.tokenizer",
    "load_tokenizer": "gyre_jax.serving.tokenizer",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name):
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'gyre_jax.serving' has no attribute {name!r}")
