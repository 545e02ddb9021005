"""FakeTinyEngine: a JAX-free serving backend for the RL loop that answers 'tiny' tasks.

The loop's stress test (tests/test_rl_stress.py) runs the real loop (cells,
elastic steps, proxy, router with drains and KV moves, harness, graders,
store, processor, checkpoints) with this in place of the JetStream engine, so
rollouts cost no compute and are a pure function of the rollout: the reply to
a task is the ideal tool call, with the answer right for two rollouts in three
and one character wrong for the others (chosen by a CRC of the rollout id), so
groups have different rewards and the policy gradient is not zero. It loads
weights the way the loop's engines do (``engine.publish(params, version)``)
and records the version it serves with each call.

Built on ``FakeBackend`` (token-by-token streaming, export/resume for drains).
"""
from __future__ import annotations

import zlib
from typing import Sequence

from gyre_jax.agents.tasks.tiny import expected_answer
from gyre_jax.serving.backend import GenerateRequest
from gyre_jax.testing.fake_backend import FakeBackend


class FakeTinyEngine(FakeBackend):
    def __init__(self, name: str, tokenizer, *, version: int, capacity: int, max_context: int, vocab_size: int):
        super().__init__(name, vocab_size=vocab_size, capacity=capacity, max_context=max_context,
                         policy_version=version, script_for=self._script_for)
        self.tok = tokenizer
        self.engine = self  # the loop loads weights through backend.engine.publish
        self.loads: list[int] = []  # versions published to it, in order

    def publish(self, params, version: int) -> None:
        self._version = int(version)
        self.loads.append(int(version))

    def reply(self, request: GenerateRequest) -> list[int]:
        """The whole reply (token ids, ending with the end-of-turn token) for this call."""
        text = self.tok.decode([int(t) for t in request.prompt_ids])
        task = text.rsplit("user\n", 1)[-1].split("<|im_end|>", 1)[0].splitlines()[0].strip()  # "copy abc"
        op, _, arg = task.partition(" ")
        try:
            answer = expected_answer(op, arg)
        except ValueError:
            answer = "?"
        key = request.cache_key or request.request_id
        if zlib.crc32(key.encode()) % 3 == 0:  # one rollout in three gets one character wrong
            answer = answer[:-1] + ("z" if answer[-1:] != "z" else "y")
        body = f'<tool>write_file {{"path": "answer.txt", "content": "{answer}"}}</tool>\n<tool>finish</tool>'
        return self.tok.encode(body) + [self.tok.special["<|im_end|>"]]

    def _script_for(self, request: GenerateRequest):
        reply = self.reply(request)
        n_prompt = len(request.prompt_ids)

        def script(seq: Sequence[int]) -> int:
            k = len(seq) - n_prompt
            return reply[k] if k < len(reply) else reply[-1]

        return script


def fake_tiny_backend(cfg, cell, params, version: int, name: str, tok):
    """``rl.loop.build(make_backend=...)``: a FakeTinyEngine sized like the config's engines."""
    return FakeTinyEngine(name, tok, version=version, capacity=cfg.cells.max_slots, max_context=cfg.cells.max_len,
                          vocab_size=cfg.model.vocab_size)
