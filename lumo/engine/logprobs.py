"""Log-probabilities of the emitted tokens (OpenAI's `logprobs` / `top_logprobs`).

A token's logprob is log_softmax of the raw logits row that chose it: the model's own distribution, before
temperature, top-k or top-p (vLLM's default "raw" mode; the OpenAI API does not change logprobs with the
temperature either). Every decoder keeps the row of each token it emits (plain decoding: the step's
logits; a speculative event: the verify rows of the accepted path, whose logits are bitwise plain
decoding's), and `token_logprobs` turns rows into numbers so that a row's numbers never depend on the rows
beside it: on a GPU lumo.kernels.logprobs (one launch for all rows, each row's arithmetic fixed by the
vocabulary size alone), elsewhere torch one row at a time. A row then gets the same bits whether it came
alone from a plain step or among others from an event.
"""

from __future__ import annotations

import math
import operator
from dataclasses import dataclass, field

import torch

MAX_LOGPROBS = 20  # most alternatives per token (OpenAI's top_logprobs limit)


@dataclass(frozen=True)
class TokenLogprob:
    token: int
    logprob: float
    # the k most likely (id, logprob), best first; none at -inf (tokens a grammar refused)
    top: list[tuple[int, float]] = field(default_factory=list)
    # the token's place in its row, 1 = most likely: the tokens at least as likely, itself included (vLLM's
    # count, ties counted); prompt tokens only (None elsewhere: the OpenAI shapes have no rank)
    rank: int | None = None


def check_logprobs(k: object) -> int | None:
    """None (off) or the number of alternatives per token, 0..MAX_LOGPROBS."""
    if k is None:
        return None
    bad = ValueError(f"logprobs must be None or an integer in [0, {MAX_LOGPROBS}], got {k!r}")
    try:
        n = operator.index(k)  # Python's, numpy's or torch's integers; not a bool, a float or a string
    except TypeError:
        raise bad from None
    if isinstance(k, bool) or not 0 <= n <= MAX_LOGPROBS:
        raise bad
    return n


def token_logprobs(
    rows: torch.Tensor, tokens: list[int], k: int, row_by_row: bool = True, ranks: bool = False
) -> list[TokenLogprob]:
    """rows [n, V] (any float dtype): row i holds the logits that chose tokens[i]. One host copy in all.

    row_by_row: each row's numbers independent of the rows beside it (what the exactness of speculative
    decoding's logprobs needs): on CUDA lumo.kernels.logprobs (one launch for all rows), elsewhere one
    torch launch per row. False: torch on all rows at once (a prompt's rows: faster there for a block of
    hundreds of rows, bench/bench_logprobs.py). ranks: each token's rank too (TokenLogprob.rank; torch's
    path, row_by_row False).
    """
    n = rows.shape[0]
    if n != len(tokens):
        raise ValueError(f"{n} logits rows for {len(tokens)} tokens")
    if not n:
        return []
    ids = torch.as_tensor(tokens, dtype=torch.long, device=rows.device)
    k = min(k, rows.shape[1])
    if ranks and row_by_row:
        raise ValueError("ranks are computed on the rows at once (row_by_row=False)")
    if row_by_row and rows.is_cuda and rows.dtype in (torch.float32, torch.bfloat16):
        host = _row_logprobs(rows if rows.stride(1) == 1 else rows.contiguous(), ids, k).cpu().tolist()
    else:
        if row_by_row:  # one launch per row, the same whatever n; what follows is exact (no arithmetic)
            lps = [torch.log_softmax(rows[i : i + 1], dim=-1, dtype=torch.float32) for i in range(n)]
            lp = lps[0] if n == 1 else torch.cat(lps)
        else:
            lp = torch.log_softmax(rows, dim=-1, dtype=torch.float32)
        parts = [lp.gather(1, ids[:, None])]
        if k:
            top_v, top_i = torch.topk(lp, k, dim=-1)
            parts += [top_v, top_i]
        if ranks:
            parts.append((lp >= parts[0]).sum(1, keepdim=True))
        host = torch.cat([p.double() for p in parts], dim=1).cpu().tolist()  # token ids < 2^53: exact
    # Alternatives at -inf (tokens a structured output's grammar refuses) are left out: they are no
    # alternatives, and their order among themselves would be the top-k's arbitrary one.
    out = []
    for t, r in zip(tokens, host, strict=True):
        top = [(int(i), v) for v, i in zip(r[1 : 1 + k], r[1 + k : 1 + 2 * k], strict=True) if v > -math.inf]
        out.append(TokenLogprob(t, r[0], top, int(r[-1]) if ranks else None))
    return out


_workspaces: dict[tuple[torch.device, int], object] = {}  # (device, V) -> the kernel's LogprobsWorkspace


def _row_logprobs(rows: torch.Tensor, ids: torch.Tensor, k: int) -> torch.Tensor:
    """lumo.kernels.logprobs.row_logprobs with a workspace kept per (device, vocabulary) (the engine's one
    thread; the host copy after each call orders the reuse)."""
    from ..kernels.logprobs import LogprobsWorkspace, row_logprobs

    key = (rows.device, rows.shape[1])
    ws = _workspaces.get(key)
    if ws is None or ws.rows < rows.shape[0]:
        ws = _workspaces[key] = LogprobsWorkspace.new(max(32, rows.shape[0]), rows.shape[1], rows.device)
    return row_logprobs(rows, ids, k, workspace=ws)


class ScoresTokens:
    """What every decoder keeps for logprobs: `logprobs` / `prompt_logprobs` (k alternatives, None: off), set
    by the caller, and the latest prefill's / step's results in `last_prompt_logprobs` / `last_logprobs`."""

    def _init_scores(self) -> None:
        self.logprobs: int | None = None
        self.last_logprobs: list[TokenLogprob] = []
        self.prompt_logprobs: int | None = None  # the prefill then scores the prompt (no prefix reuse)
        self.last_prompt_logprobs: list[TokenLogprob] = []

    def _note_logprobs(self, rows: torch.Tensor, tokens: list[int]) -> None:
        """rows [n, V]: the logits that chose `tokens` (the ones just emitted)."""
        if self.logprobs is not None:
            self.last_logprobs = token_logprobs(rows, tokens, self.logprobs)


class PromptLogprobs:
    """The logprobs of a prompt's tokens 1.. (`out`), from a prefill's rows chunk by chunk: `logits(rows,
    start)` takes the logits of positions start.., `hidden(rows, start)` (a GPU runner's hidden_hook) the
    final-norm rows, put through `head` (the lm_head) `block` rows at a time to bound the logits' memory.
    Position p's row scores token p + 1; the prompt's last row is the first generated token's."""

    def __init__(self, ids: list[int], k: int, head=None, block: int = 256):
        self.ids, self.k, self.head, self.block = ids, k, head, block
        self.out: list[TokenLogprob] = []

    def logits(self, rows: torch.Tensor, start: int) -> None:
        nxt = self.ids[start + 1 : start + 1 + rows.shape[0]]
        if start != len(self.out):
            raise ValueError(f"prompt rows from {start}, but {len(self.out)} were scored")
        self.out += token_logprobs(rows[: len(nxt)], nxt, self.k, row_by_row=False, ranks=True)

    def hidden(self, rows: torch.Tensor, start: int) -> None:
        for lo in range(0, min(rows.shape[0], len(self.ids) - 1 - start), self.block):
            self.logits(self.head(rows[lo : lo + self.block]), start + lo)
