"""Draft vocabulary: the tokens the MTP drafter may propose (FR-Spec's frequency-ranked subset; SGLang's
`--speculative-token-map`).

Every draft step of a tree event ends in the lm_head over the whole vocabulary: on the 27B (248,320
tokens, 716 MB of NVFP4 weights per step) that is most of the draft's time. With a draft vocabulary of N
tokens the drafter's logits are computed for those N rows only and its top-k picks among them. The target
still verifies with the full lm_head, so the output is exactly what it is without one (greedy: plain
decoding's tokens; sampling: the target's own samples); only which drafts are proposed, hence the
acceptance, can change.

`draft_vocab_ids` turns the user's choice into sorted token ids:
- an integer N: N ids in all, the tokenizer's added tokens (end of text, chat and reasoning / tool
  markers: the drafter must be able to propose them) and the lowest other ids. Byte-level BPE vocabularies
  (Qwen's included) number their tokens in merge order, which follows frequency in the tokenizer's
  training text, so the lowest ids are a frequency ranking's stand-in;
- a file of token ids, used as it is (the tool below includes the added tokens), e.g. a frequency ranking
  made from the user's own traffic (`python -m lumo.engine.draft_vocab MODEL SIZE TEXT... -o ids.json`
  writes one): a JSON list, integers separated by white space or commas, or a torch tensor saved with
  torch.save (.pt, SGLang's token-map format).

Measured on the embedded model (3,072 tokens, held-out prompts, CPU reference engine, greedy): accepted
drafts per event 2.87 with the whole vocabulary, 2.25 with the 1,024 most frequent tokens of its training
text, 1.74 with the 1,024 lowest ids. With Qwen's 151,643-token BPE the 32,768 lowest ids cover ~91-93%
of the tokens of code and English text, the 32,768 most frequent of similar text ~99%
(bench/results/draft_vocab_coverage_session11.log). So rank the tokens on real text where possible (the
tool above prints the share of its input the chosen tokens cover).
"""

from __future__ import annotations

import json
import numbers
import os
import re
from collections import Counter
from collections.abc import Iterable
from pathlib import Path

import torch

MIN_DRAFT_VOCAB = 8  # the drafter's top-k takes up to 8 siblings (lumo.kernels.tree_ops.KMAX)


def _read_ids(path: Path) -> list[int]:
    if path.suffix in (".pt", ".pth"):
        try:
            t = torch.load(path, map_location="cpu", weights_only=True)
        except Exception as e:  # noqa: BLE001 - any unreadable file is the user's error
            raise ValueError(f"draft vocabulary {path}: not a torch tensor file ({e})") from None
        if (
            not isinstance(t, torch.Tensor)
            or t.is_floating_point()
            or t.is_complex()
            or t.dtype == torch.bool
        ):
            raise ValueError(f"draft vocabulary {path}: expected an integer tensor of token ids")
        return [int(i) for i in t.flatten().tolist()]
    text = path.read_text()
    try:
        data = json.loads(text)
    except json.JSONDecodeError:
        data = None
    if isinstance(data, list):
        if not all(isinstance(i, int) and not isinstance(i, bool) for i in data):
            raise ValueError(f"draft vocabulary {path}: the JSON list must hold integer token ids")
        return data
    words = [w for w in re.split(r"[\s,]+", text.strip()) if w]
    if not words or not all(re.fullmatch(r"-?\d+", w) for w in words):
        raise ValueError(
            f"draft vocabulary {path}: expected token ids (a JSON list, or integers separated by white space "
            "or commas, or a .pt tensor)"
        )
    return [int(w) for w in words]


def draft_vocab_ids(spec: int | str | os.PathLike, vocab_size: int, keep: Iterable[int] = ()) -> list[int]:
    """Sorted unique token ids of a draft vocabulary (see the module doc). spec: a size N (an int, or a
    string of digits) or a path to a file of ids. keep: ids always included with a size (added tokens).
    Raises ValueError for a size below MIN_DRAFT_VOCAB, a missing or malformed file, or an id outside
    [0, vocab_size)."""
    if isinstance(spec, str) and spec.strip().isdigit():
        spec = int(spec)
    if isinstance(spec, bool) or not isinstance(spec, (numbers.Integral, str, os.PathLike)):
        raise ValueError(f"draft vocabulary must be a size or a file of token ids, got {spec!r}")
    if isinstance(spec, numbers.Integral):
        spec = int(spec)
        if spec < MIN_DRAFT_VOCAB:
            raise ValueError(f"draft vocabulary size must be at least {MIN_DRAFT_VOCAB}, got {spec}")
        kept = sorted({int(i) for i in keep if 0 <= int(i) < vocab_size})
        if len(kept) > spec:
            raise ValueError(
                f"draft vocabulary size {spec} is smaller than the tokenizer's {len(kept)} added tokens"
            )
        ids = set(kept)
        low = 0
        while len(ids) < min(spec, vocab_size):
            ids.add(low)
            low += 1
        return sorted(ids)
    path = Path(spec)
    if not path.is_file():
        raise ValueError(f"draft vocabulary: no such file {str(path)!r} (give a size or a file of token ids)")
    ids = sorted(set(_read_ids(path)))
    bad = [i for i in ids if not 0 <= i < vocab_size]
    if bad:
        raise ValueError(f"draft vocabulary {path}: token id {bad[0]} outside [0, {vocab_size})")
    if len(ids) < MIN_DRAFT_VOCAB:
        raise ValueError(f"draft vocabulary {path}: {len(ids)} ids, at least {MIN_DRAFT_VOCAB} needed")
    return ids


def frequency_ranked_ids(
    token_lists: Iterable[Iterable[int]], size: int, keep: Iterable[int] = ()
) -> list[int]:
    """The `size` most frequent ids over the token lists (ties: the lower id), `keep` first included;
    sorted. A draft vocabulary file from the user's own text (`python -m lumo.engine.draft_vocab`)."""
    counts: Counter = Counter()
    for ids in token_lists:
        counts.update(ids)
    chosen = set(keep)
    for tok, _ in sorted(counts.items(), key=lambda kv: (-kv[1], kv[0])):
        if len(chosen) >= size:
            break
        chosen.add(tok)
    return sorted(chosen)


def main(argv: list[str] | None = None) -> int:
    """python -m lumo.engine.draft_vocab MODEL SIZE TEXT... -o IDS.json: a frequency-ranked draft
    vocabulary of SIZE tokens (the model's added tokens included) from text files, for --draft-vocab."""
    import argparse
    import sys

    from ..tokenizer import Tokenizer
    from ..weights import resolve_model_path

    ap = argparse.ArgumentParser(prog="python -m lumo.engine.draft_vocab", description=main.__doc__)
    ap.add_argument("model", help="model directory or hub id (its tokenizer)")
    ap.add_argument("size", type=int, help="tokens in the draft vocabulary")
    ap.add_argument("text", nargs="+", help="text files typical of the traffic (UTF-8)")
    ap.add_argument("-o", "--out", required=True, help="JSON file to write (a list of token ids)")
    args = ap.parse_args(argv)
    try:
        if args.size < MIN_DRAFT_VOCAB:
            raise ValueError(f"size must be at least {MIN_DRAFT_VOCAB}, got {args.size}")
        tok = Tokenizer.from_dir(resolve_model_path(args.model))
        if len(tok.added_token_ids()) > args.size:
            raise ValueError(f"size {args.size} is smaller than the tokenizer's added tokens")
        lists = [tok.encode(Path(p).read_text(encoding="utf-8", errors="replace")) for p in args.text]
        ids = frequency_ranked_ids(lists, args.size, tok.added_token_ids())
        Path(args.out).write_text(json.dumps(ids))
    except (OSError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    chosen = set(ids)
    seen = sum(len(x) for x in lists)
    covered = sum(1 for x in lists for t in x if t in chosen)
    print(f"{len(ids)} ids to {args.out}; they cover {covered / max(seen, 1):.1%} of the {seen} tokens read")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
