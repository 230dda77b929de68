"""Token logprobs (lumo.engine.logprobs) in the two OpenAI shapes, chat's `logprobs.content` entries and
the completions API's parallel lists, and vLLM's `prompt_logprobs`. as_ids (vLLM's
return_tokens_as_token_ids): tokens named `token_id:N` rather than by their text, for clients that map
them back to ids exactly (a token's text may be part of a character, or shared by two tokens)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from ..engine.logprobs import TokenLogprob
from ..tokenizer import Tokenizer

FLOOR = -9999.0  # OpenAI's stand-in for a logprob of -inf (JSON has no infinity)


def _lp(x: float) -> float:
    return x if x > FLOOR else FLOOR  # NaN never comes from a log_softmax of finite logits


def _namer(tok: Tokenizer, as_ids: bool) -> Callable[[int], str]:
    return (lambda i: f"token_id:{i}") if as_ids else tok.token_text


def chat_entries(tok: Tokenizer, lps: list[TokenLogprob], as_ids: bool = False) -> list[dict[str, Any]]:
    """`choices[].logprobs.content` (chat): per token its text, logprob, bytes (the token's own, also
    with as_ids) and top alternatives."""
    name = _namer(tok, as_ids)

    def one(i: int, lp: float) -> dict[str, Any]:
        return {"token": name(i), "logprob": _lp(lp), "bytes": list(tok.token_bytes(i))}

    return [{**one(t.token, t.logprob), "top_logprobs": [one(i, v) for i, v in t.top]} for t in lps]


def completion_logprobs(
    tok: Tokenizer, ids: list[int], lps: list[TokenLogprob | None], offsets: list[int], as_ids: bool = False
) -> dict[str, Any]:
    """`choices[].logprobs` (completions) of tokens `ids`: tokens, token_logprobs, top_logprobs (the k most
    likely and the chosen token, text -> logprob; where two tokens share a text, the more likely one's) and
    text_offset (`offsets`: where each token's text starts in the response text). A None in lps (an echoed
    prompt's first token) gives null logprobs."""
    name = _namer(tok, as_ids)
    tokens = [name(i) for i in ids]
    tops: list[dict[str, float] | None] = []
    for t, s in zip(lps, tokens, strict=True):
        if t is None:
            tops.append(None)
            continue
        top: dict[str, float] = {}
        for i, v in t.top:  # best first: the first of a text stays
            top.setdefault(name(i), _lp(v))
        top.setdefault(s, _lp(t.logprob))
        tops.append(top)
    return {
        "tokens": tokens,
        "token_logprobs": [None if t is None else _lp(t.logprob) for t in lps],
        "top_logprobs": tops,
        "text_offset": list(offsets),
    }


def prompt_entries(tok: Tokenizer, lps: list[TokenLogprob | None], k: int) -> list[dict[str, Any] | None]:
    """vLLM's `prompt_logprobs`: per prompt token (the first: null, nothing scores it) a mapping token id ->
    {logprob, rank, decoded_token} of the token itself and its k most likely alternatives (ranks 1..k)."""

    def one(i: int, lp: float, rank: int | None) -> dict[str, Any]:
        return {"logprob": _lp(lp), "rank": rank, "decoded_token": tok.token_text(i)}

    out: list[dict[str, Any] | None] = []
    for t in lps:
        if t is None:
            out.append(None)
            continue
        entry = {str(t.token): one(t.token, t.logprob, t.rank)}
        for r, (i, v) in enumerate(t.top[:k], 1):
            entry.setdefault(str(i), one(i, v, r))
        out.append(entry)
    return out


def extend(total: dict[str, Any] | None, part: dict[str, Any] | None) -> dict[str, Any] | None:
    """Two completion_logprobs results (consecutive pieces of one text) as one."""
    if total is None or part is None:
        return part or total
    return {k: total[k] + part[k] for k in total}
