"""Benchmark: how often re-rendering a conversation gives other tokens than the model produced.

An agent harness sends the conversation back as messages; the proxy re-renders them with
the chat template and tokenizes. Whenever that re-render differs from the tokens the model
actually generated (the paper's TITO point), a trainer that re-tokenizes conversations
trains on tokens the policy never sampled; gyre_jax keeps the recorded tokens instead, and
the trajectory tree branches where the next prompt drifts (tests/test_hf_tokenizer.py).

Setup: a byte-level BPE tokenizer (--vocab, trained here on agent text of tasks disjoint
from the measured ones; or --tokenizer DIR, a real checkpoint's) with the Qwen3 chat
template. Conversations: the scripted agent transcripts of --conversations tasks
(repo_spec and tiny families: multi-turn, parallel tool calls, tool results). Each
assistant turn is "generated" as the canonical BPE tokens of the text a model writes in one
of these styles, chosen uniformly at random per turn (seeded):

  canonical     exactly the template's form (text, "\\n", <tool_call>\\n{json}\\n</tool_call>)
  think         a <think>reasoning</think> block first (Qwen3 thinking mode)
  empty_think   an empty <think>\\n\\n</think> block first
  compact_json  tool-call JSON without spaces ({"name":"x","arguments":{...}})
  no_separator  no "\\n" between the text and the first <tool_call>

and, independently, each generated non-special token is with probability --resample_p
replaced by a non-canonical split of its text (same text, other tokens: what a sampling
model sometimes emits). The output is parsed (the proxy's parser) and the next prompt
rendered from the parsed message, as the harness would send it back. A turn drifts if the
next prompt does not start with prompt + generated tokens (a conversation's last turn has
no next prompt and is not counted). Printed: a table per style,
then one JSON line with drift_fraction (turns), conversation_drift_fraction (of those with a
re-rendered turn) and
off_path_token_fraction (generated tokens a re-tokenizing pipeline would not train on
as sampled).

    python tools/bench_retokenize_drift.py            # 200 conversations, ~20 s
    python tools/bench_retokenize_drift.py --resample_p 0 --conversations 50
"""
from __future__ import annotations

import collections
import json
import os
import tempfile

import numpy as np

import benchkit

STYLES = ("canonical", "think", "empty_think", "compact_json", "no_separator")


def _normalize(msgs):
    out = []
    for m in msgs:
        n = {"role": m["role"], "content": m.get("content") or ""}
        if m.get("tool_calls"):
            n["tool_calls"] = []
            for tc in m["tool_calls"]:
                fn = tc.get("function", tc)
                args = fn.get("arguments") or {}
                n["tool_calls"].append({"id": tc.get("id"), "name": fn["name"],
                                        "arguments": json.loads(args) if isinstance(args, str) else args})
        if m.get("tool_call_id"):
            n["tool_call_id"] = m["tool_call_id"]
        out.append(n)
    return out


def _tools(d):
    return [{"name": t["function"]["name"], "description": t["function"].get("description", ""),
             "parameters": t["function"].get("parameters") or {}} for t in d.tools or ()]


def conversations(seeds):
    from gyre_jax.agents.demos import demonstration
    from gyre_jax.agents.tasks import make_task

    out = []
    for s in seeds:
        fam = "repo_spec" if s % 2 else "tiny"
        d = demonstration(make_task(fam, int(s)), text_format=False)
        out.append((_normalize(d.messages), _tools(d)))
    return out


def written_text(msg, style, rng):
    """The text a model writes for ``msg`` in ``style`` (Qwen tool-call syntax)."""
    text = msg["content"]
    if style == "think":
        text = f"<think>\nI should {rng.choice(['look at the files', 'check the spec', 'write the answer'])}.\n</think>\n\n" + text
    elif style == "empty_think":
        text = "<think>\n\n</think>\n\n" + text
    calls = []
    for tc in msg.get("tool_calls") or ():
        if style == "compact_json":
            body = json.dumps({"name": tc["name"], "arguments": tc["arguments"]}, separators=(",", ":"),
                              ensure_ascii=False)
        else:
            body = '{"name": "' + tc["name"] + '", "arguments": ' + json.dumps(tc["arguments"], ensure_ascii=False) + "}"
        calls.append("<tool_call>\n" + body + "\n</tool_call>")
    if calls:  # the template puts "\n" between the message's content (if any) and the first call
        sep = "\n" if msg["content"] and style != "no_separator" else ""
        text = text + sep + "\n".join(calls)
    return text


def generated_ids(tok, text, p, rng):
    ids = tok.encode_with_special(text)
    if p <= 0:
        return ids
    added = set(tok.tk.get_added_tokens_decoder())
    out = []
    for t in ids:
        s = tok.decode([t]) if t not in added else ""
        if len(s) >= 2 and "\ufffd" not in s and rng.random() < p:
            k = int(rng.integers(1, len(s)))
            split = tok.encode(s[:k]) + tok.encode(s[k:])
            out += split if split != [t] else [t]
        else:
            out.append(t)
    return out


def measure(tok, convs, p, seed):
    rng = np.random.default_rng(seed)
    by_style = collections.defaultdict(lambda: collections.Counter())
    conv_drift = multi = 0  # multi: conversations with a re-rendered turn (2+ assistant turns)
    tokens = off_path = 0
    for msgs, tools in convs:
        history = []  # what the harness sends back: parsed assistant messages, tool results as they were
        drifted = False
        pending = None  # (style, prompt + generated ids) of the previous turn, checked against the next prompt
        for m in msgs:
            if m["role"] != "assistant":
                history.append(m)
                continue
            prompt = tok.render_chat(history, tools)
            if pending is not None:  # the previous turn, as re-rendered inside this prompt
                style, seq, n_prompt = pending
                same = prompt[: len(seq)] == seq
                if not same:
                    d = next((j for j, (a, b) in enumerate(zip(seq, prompt)) if a != b), min(len(seq), len(prompt)))
                    off_path += len(seq) - max(d, n_prompt)
                tokens += len(seq) - n_prompt
                by_style[style]["turns"] += 1
                by_style[style]["drift"] += not same
                drifted |= not same
            style = STYLES[int(rng.integers(len(STYLES)))]
            out = generated_ids(tok, written_text(m, style, rng), p, rng) + [tok.stop_ids[0]]
            parsed = tok.parse_assistant(out)
            ok = [(c["name"], c["arguments"]) for c in parsed["tool_calls"]] == \
                 [(c["name"], c["arguments"]) for c in m.get("tool_calls") or ()]
            by_style[style]["parse_failed"] += not ok
            history.append({"role": "assistant", "content": parsed["content"], "tool_calls": parsed["tool_calls"]})
            pending = (style, prompt + out, len(prompt))
        conv_drift += drifted
        multi += any(mm["role"] == "assistant" for mm in msgs[: max(i for i, mm in enumerate(msgs)
                                                                   if mm["role"] == "assistant")])
    return by_style, conv_drift / max(multi, 1), tokens, off_path


def _train_tokenizer(path, vocab, seeds):
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers

    from gyre_jax.serving.hf_tokenizer import builtin_template

    corpus = []
    for msgs, tools in conversations(seeds):
        corpus += [m["content"] for m in msgs]
        corpus += [json.dumps({"name": c["name"], "arguments": c["arguments"]}) for m in msgs
                   for c in m.get("tool_calls") or ()]
        corpus += [json.dumps(t) for t in tools]
    tk = Tokenizer(models.BPE())
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tk.decoder = decoders.ByteLevel()
    tk.train_from_iterator(corpus, trainers.BpeTrainer(
        vocab_size=vocab, special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"], show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tk.add_tokens([AddedToken(t, special=False, normalized=False) for t in
                   ("<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>", "<think>", "</think>")])
    tk.save(os.path.join(path, "tokenizer.json"))
    with open(os.path.join(path, "tokenizer_config.json"), "w") as f:
        json.dump({"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>", "bos_token": None,
                   "chat_template": builtin_template("qwen3")}, f)


def main(argv=None) -> dict:
    bench = benchkit.Bench(__file__, __doc__, quick=dict(conversations=4, vocab=600, train_conversations=10))
    p = bench.parser
    p.add_argument("--conversations", type=int, default=200)
    p.add_argument("--resample_p", type=float, default=0.01)
    p.add_argument("--vocab", type=int, default=4000)
    p.add_argument("--train_conversations", type=int, default=200, help="tasks the BPE tokenizer is trained on")
    p.add_argument("--tokenizer", default="", help="a checkpoint directory with its own tokenizer + Qwen-style template")
    p.add_argument("--seed", type=int, default=0)
    args = bench.parse(argv)
    from gyre_jax.serving.hf_tokenizer import HFChatTokenizer

    sw = benchkit.Stopwatch.started()
    with tempfile.TemporaryDirectory() as d:
        if args.tokenizer:
            tok = HFChatTokenizer.from_dir(args.tokenizer)
        else:
            _train_tokenizer(d, args.vocab, range(10_000, 10_000 + args.train_conversations))
            tok = HFChatTokenizer.from_dir(d)
    if tok.tool_format != "qwen":
        raise SystemExit(f"{args.tokenizer}: this benchmark writes Qwen-syntax tool calls; got {tok.tool_format}")
    convs = conversations(range(args.conversations))
    by_style, conv_frac, tokens, off_path = measure(tok, convs, args.resample_p, args.seed)
    print(f"tokenizer: {'trained BPE' if not args.tokenizer else args.tokenizer}, vocab {tok.vocab_size}, Qwen3 "
          f"template; {len(convs)} conversations, resample_p={args.resample_p} ({sw.s:.1f}s)\n")
    print(f"{'style':14} {'turns':>6} {'drifted':>8} {'fraction':>9} {'parse_failed':>13}")
    tot = collections.Counter()
    for s in STYLES:
        c = by_style[s]
        tot.update(c)
        print(f"{s:14} {c['turns']:6d} {c['drift']:8d} {c['drift'] / max(c['turns'], 1):9.3f} {c['parse_failed']:13d}")
    print(f"{'all':14} {tot['turns']:6d} {tot['drift']:8d} {tot['drift'] / tot['turns']:9.3f} {tot['parse_failed']:13d}")
    return bench.emit(dict(
        drift_fraction=round(tot["drift"] / tot["turns"], 4),
        conversation_drift_fraction=round(conv_frac, 4),
        off_path_token_fraction=round(off_path / max(tokens, 1), 4),
        **{f"drift_{s}": round(by_style[s]["drift"] / max(by_style[s]["turns"], 1), 4) for s in STYLES},
        turns=tot["turns"], conversations=len(convs), resample_p=args.resample_p, vocab=tok.vocab_size,
        parse_failed=tot["parse_failed"]), sizes=dict(conversations=len(convs), resample_p=args.resample_p,
                                                      vocab=tok.vocab_size, tokenizer=args.tokenizer or "trained BPE",
                                                      seed=args.seed, train_conversations=args.train_conversations))


if __name__ == "__main__":
    main()
