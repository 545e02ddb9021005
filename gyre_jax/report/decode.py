"""Token ids back to chat turns, for people: which role said what, in the chat template's own markers.

The store keeps ids, never text (the exact tokens are what training needs). To show a rollout, each
node of its rebuilt tree is decoded once (a node is a span every path through it shares, so a
100-call context is decoded once, not 100 times) into *pieces*, ``[role, text, flags, tokens]``:

* ``role``: the chat role the span belongs to (``system``, ``user``, ``assistant``, ``tool``, the
  template's own names), "" outside any turn (a BOS token, the template's preamble);
* ``flags``: ``START`` where a turn begins (the piece is the role's name), ``SPECIAL`` for a special
  token's own text (shown faintly: ``<|tool_result|>``, ``<tool_call>``), ``END`` for the marker that
  ends a turn; so two turns of one role in a row stay two turns;
* ``tokens``: how many ids the piece covers (the viewer places the prompt/completion boundary and
  the "new since this agent's previous call" mark by token position).

Turn markers are read from the tokenizer's special tokens, in the two layouts the project's
templates use: ChatML (``<|im_start|>ROLE\\n ... <|im_end|>``: the built-in byte tokenizer, Qwen,
SmolLM2) and Llama-3 (``<|start_header_id|>ROLE<|end_header_id|> ... <|eot_id|>``). A template with
neither decodes as one role-less text, never wrongly split. The role a node starts in is the one
its parent ended in (``DecodeState``), so a turn that spans a branch point keeps its role.
"""
from __future__ import annotations

import dataclasses
from typing import Sequence

import numpy as np

START, SPECIAL, END = 1, 2, 4
_OPEN_CHATML, _OPEN_LLAMA, _HEADER_END = "<|im_start|>", "<|start_header_id|>", "<|end_header_id|>"
_TURN_ENDS = ("<|im_end|>", "<|eot_id|>", "<|eom_id|>")


@dataclasses.dataclass(frozen=True)
class DecodeState:
    """Where a span starts: inside a turn of ``role``, or reading a role's name (``naming``)."""

    role: str = ""
    naming: str | None = None  # the role name read so far after an opening marker (None: not reading one)
    closer: str = ""  # what ends the name: "\n" (ChatML) or the header-end marker (Llama-3)


def special_tokens(tok) -> dict[int, str]:
    """id -> text of the tokenizer's special tokens (the built-in ones, or a HF tokenizer's added specials)."""
    raw = getattr(tok, "tk", None)  # serving.hf_tokenizer.HFChatTokenizer wraps a `tokenizers.Tokenizer`
    if raw is not None and hasattr(raw, "get_added_tokens_decoder"):
        return {int(i): t.content for i, t in raw.get_added_tokens_decoder().items() if t.special}
    return {int(i): name for name, i in getattr(tok, "special", {}).items()}


class TurnDecoder:
    """``pieces(ids, state) -> (pieces, state)`` over one tokenizer (module docstring)."""

    def __init__(self, tok):
        self.tok = tok
        self.special = special_tokens(tok)
        self._is_special = np.zeros(max(self.special, default=-1) + 1, bool)  # id -> special, a lookup table
        self._is_special[list(self.special)] = True
        names = set(self.special.values())
        self.layout = "chatml" if _OPEN_CHATML in names else "llama3" if _OPEN_LLAMA in names else "plain"
        # The byte tokenizer's decode, vectorized (its own is a Python loop per id): ids 0..255 are the bytes.
        self._bytes = type(tok).__name__ == "ByteTokenizer"

    def _text(self, ids: np.ndarray) -> str:
        if not ids.shape[0]:
            return ""
        if self._bytes:
            return ids[(ids >= 0) & (ids < 256)].astype(np.uint8).tobytes().decode("utf-8", errors="replace")
        return self.tok.decode([int(i) for i in ids])

    def pieces(self, ids: Sequence[int] | np.ndarray, state: DecodeState = DecodeState()) -> tuple[list[list], DecodeState]:
        """The pieces of one span of ids read from ``state``, and the state after it."""
        arr = np.asarray(ids, np.int64)
        out: list[list] = []
        if not arr.shape[0]:
            return out, state
        n = self._is_special.shape[0]
        is_special = (arr < n) & self._is_special[np.minimum(arr, max(n - 1, 0))] if n else np.zeros(arr.shape, bool)
        cuts = np.flatnonzero(is_special)
        bounds = sorted({0, arr.shape[0], *cuts.tolist(), *(cuts + 1).tolist()})
        for a, b in zip(bounds[:-1], bounds[1:]):
            if is_special[a]:
                state = self._special(self.special[int(arr[a])], state, out)
            else:
                state = self._plain(self._text(arr[a:b]), b - a, state, out)
        return _merge(out), state

    def _special(self, name: str, state: DecodeState, out: list) -> DecodeState:
        if self.layout == "chatml" and name == _OPEN_CHATML:
            out.append(["", name, SPECIAL, 1])
            return DecodeState(naming="", closer="\n")
        if self.layout == "llama3" and name == _OPEN_LLAMA:
            out.append(["", name, SPECIAL, 1])
            return DecodeState(naming="", closer=_HEADER_END)
        if state.naming is not None and name == state.closer:  # Llama-3: the role's name is complete
            role = state.naming.strip() or "?"
            out.append([role, name, SPECIAL | START, 1])
            return DecodeState(role=role)
        if name in _TURN_ENDS:
            out.append([state.role, name, SPECIAL | END, 1])
            return DecodeState()
        out.append([state.role, name, SPECIAL, 1])
        return state

    def _plain(self, text: str, n: int, state: DecodeState, out: list) -> DecodeState:
        if state.naming is None:
            out.append([state.role, text, 0, n])
            return state
        if state.closer != "\n" or "\n" not in text:  # still reading the role's name
            out.append(["", text, SPECIAL, n])
            return dataclasses.replace(state, naming=state.naming + text)
        name, _, rest = text.partition("\n")
        role = (state.naming + name).strip() or "?"
        # The span's tokens go with the name piece (a split id count would be a guess); the text follows.
        out.append([role, name + "\n", SPECIAL | START, n if not rest else 0])
        if rest:
            out.append([role, rest, 0, n])
        return DecodeState(role=role)


def _merge(pieces: list[list]) -> list[list]:
    """Neighbouring pieces of one role and kind as one (a span of many short runs stays small)."""
    out: list[list] = []
    for p in pieces:
        if out and p[2] == 0 and out[-1][2] == 0 and out[-1][0] == p[0]:
            out[-1][1] += p[1]
            out[-1][3] += p[3]
        else:
            out.append(p)
    return out


def completion(tok, output_ids: Sequence[int]) -> dict:
    """A call's output as the proxy's parser reads it (``Tokenizer.parse_assistant``): text and tool calls."""
    try:
        parsed = tok.parse_assistant([int(i) for i in output_ids])
    except Exception as e:  # noqa: BLE001 - a parser error is shown, never hides the rest of the report
        return {"content": "", "tool_calls": [], "error": f"{type(e).__name__}: {e}"}
    calls = [{"name": c.get("name"), "arguments": c.get("arguments"), "id": c.get("id")}
             for c in parsed.get("tool_calls") or ()]
    return {"content": parsed.get("content") or "", "tool_calls": calls, "stopped": bool(parsed.get("stopped"))}
