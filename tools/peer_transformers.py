"""transformers on torch (CPU) as the reference and the speed peer for a real checkpoint, run in its own venv.

torch + transformers are not dependencies of gyre_jax: run this file with a Python that has them
(``python3 -m venv /work/torchvenv && /work/torchvenv/bin/pip install torch transformers safetensors gguf
accelerate``; the CPU build of torch). Our tests and benches start it as a subprocess and read one JSON
line from its stdout.

    # logits and greedy tokens of a chat prompt (tests/test_gguf.py pins them)
    /work/torchvenv/bin/python tools/peer_transformers.py reference --model M.gguf --prompt-ids '[1, 2, ...]' --new 16
    # decode tokens/s at several batch sizes, and a forward+backward step's tokens/s (tools/bench_real_learning.py)
    /work/torchvenv/bin/python tools/peer_transformers.py speed --model M.gguf --prompt-ids '[...]' --batches 1,8,32 \\
        --new 32 --train-len 1024

A ``.gguf`` path loads with ``from_pretrained(dir, gguf_file=name)`` (dequantized to float32).
"""
from __future__ import annotations

import json
import os

import benchkit  # tools/, beside this script: stdlib only, so it loads in the peer's own venv


def load(path: str, threads: int):
    import torch
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(threads)
    kw = {"gguf_file": os.path.basename(path)} if path.endswith(".gguf") else {}
    d = os.path.dirname(path) if path.endswith(".gguf") else path
    return benchkit.timed(lambda: AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32, **kw).eval())


def reference(args) -> dict:
    import torch

    m, load_s = load(args.model, args.threads)
    ids = json.loads(args.prompt_ids)
    with torch.no_grad():
        logits = m(input_ids=torch.tensor([ids])).logits[0].double()
        out = m.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                         do_sample=False, max_new_tokens=args.new, pad_token_id=m.config.eos_token_id)
    last = logits[-1]
    top = torch.topk(last, args.top)
    return {"argmax": logits.argmax(-1).tolist(), "top_ids": top.indices.tolist(), "top_logits": top.values.tolist(),
            "logsumexp": float(torch.logsumexp(last, -1)), "greedy": out[0, len(ids):].tolist(), "load_s": load_s,
            "torch": torch.__version__, "transformers": __import__("transformers").__version__}


def speed(args) -> dict:
    """Greedy decode tokens/s at each batch size (every row the same prompt, KV cache on, ``new`` tokens), and
    one forward+backward over a ``train_len`` row (loss = mean token NLL) in tokens/s."""
    import torch

    m, load_s = load(args.model, args.threads)
    ids = json.loads(args.prompt_ids)
    res: dict = {"load_s": load_s, "threads": torch.get_num_threads(), "decode": {}, "torch": torch.__version__,
                 "transformers": __import__("transformers").__version__}
    for b in [int(x) for x in args.batches.split(",")]:
        x = torch.tensor([ids] * b)
        mask = torch.ones_like(x)
        with torch.no_grad():
            m.generate(x, attention_mask=mask, do_sample=False, max_new_tokens=2, pad_token_id=m.config.eos_token_id)
            out, dt = benchkit.timed(m.generate, x, attention_mask=mask, do_sample=False, max_new_tokens=args.new,
                                     min_new_tokens=args.new, pad_token_id=m.config.eos_token_id)
        res["decode"][str(b)] = {"s": dt, "tokens": b * args.new, "tok_s": b * args.new / dt,
                                 "greedy_row0": out[0, len(ids):].tolist()}
    if args.train_len:
        m.train()
        g = torch.Generator().manual_seed(0)
        row = torch.randint(0, m.config.vocab_size, (1, args.train_len), generator=g)

        def step():
            m(input_ids=row, labels=row).loss.backward()
            m.zero_grad(set_to_none=True)

        best = benchkit.best_of(step, args.train_reps, warmup=1)
        res["train"] = {"len": args.train_len, "s": best, "tok_s": args.train_len / best}
    return res


def main():
    ap = benchkit.tool_parser(__file__, __doc__)
    ap.add_argument("what", choices=("reference", "speed"))
    ap.add_argument("--model", required=True)
    ap.add_argument("--prompt-ids", required=True, help="JSON list of token ids")
    ap.add_argument("--new", type=int, default=16, help="tokens to generate")
    ap.add_argument("--top", type=int, default=8)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--batches", default="1,8,32")
    ap.add_argument("--train-len", type=int, default=0)
    ap.add_argument("--train-reps", type=int, default=2)
    args = ap.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    print(json.dumps(reference(args) if args.what == "reference" else speed(args)), flush=True)


if __name__ == "__main__":
    main()
