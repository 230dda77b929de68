"""Token logprobs (lumo.engine.logprobs) in the two OpenAI shapes: chat's `logprobs.content` entries and
the completions API's parallel lists."""

from __future__ import annotations

from typing import Any

from ..engine.logprobs import TokenLogprob
from ..tokenizer import Tokenizer

FLOOR = -9999.0  # OpenAI's stand-in for a logprob of -inf (JSON has no infinity)


def _lp(x: float) -> float:
    return x if x > FLOOR else FLOOR  # NaN never comes from a log_softmax of finite logits


def chat_entries(tok: Tokenizer, lps: list[TokenLogprob]) -> list[dict[str, Any]]:
    """`choices[].logprobs.content` (chat): per token its text, logprob, bytes and top alternatives."""

    def one(i: int, lp: float) -> dict[str, Any]:
        return {"token": tok.token_text(i), "logprob": _lp(lp), "bytes": list(tok.token_bytes(i))}

    return [{**one(t.token, t.logprob), "top_logprobs": [one(i, v) for i, v in t.top]} for t in lps]


def completion_logprobs(
    tok: Tokenizer, ids: list[int], lps: list[TokenLogprob | None], offsets: list[int]
) -> dict[str, Any]:
    """`choices[].logprobs` (completions) of tokens `ids`: tokens, token_logprobs, top_logprobs (the k most
    likely and the chosen token, text -> logprob; where two tokens share a text, the more likely one's) and
    text_offset (`offsets`: where each token's text starts in the response text). A None in lps (an echoed
    prompt's first token) gives null logprobs."""
    tokens = [tok.token_text(i) for i in ids]
    tops: list[dict[str, float] | None] = []
    for t, s in zip(lps, tokens, strict=True):
        if t is None:
            tops.append(None)
            continue
        top: dict[str, float] = {}
        for i, v in t.top:  # best first: the first of a text stays
            top.setdefault(tok.token_text(i), _lp(v))
        top.setdefault(s, _lp(t.logprob))
        tops.append(top)
    return {
        "tokens": tokens,
        "token_logprobs": [None if t is None else _lp(t.logprob) for t in lps],
        "top_logprobs": tops,
        "text_offset": list(offsets),
    }


def extend(total: dict[str, Any] | None, part: dict[str, Any] | None) -> dict[str, Any] | None:
    """Two completion_logprobs results (consecutive pieces of one text) as one."""
    if total is None or part is None:
        return part or total
    return {k: total[k] + part[k] for k in total}
