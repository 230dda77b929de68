"""The embedded model's corpus and tokenizer: Python standard-library source, present offline everywhere.

The corpus is the running interpreter's own stdlib `.py` files (`sysconfig.get_paths()["stdlib"]`), split
by file into train, validation and held-out sets by a hash of the relative path, so the split is
deterministic and a benchmark can draw unseen prompts from the same held-out files the model was evaluated on.
The tokenizer is a byte-level BPE in the Qwen2 style (a regex pre-split, then bytes).
"""

from __future__ import annotations

import hashlib
import sysconfig
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, trainers

from .testing import ADDED_TOKENS, SPECIAL_TOKENS

EOT = "<|endoftext|>"
# Qwen2's pre-tokenizer split: letters with one leading non-letter, single digits, punctuation runs,
# newline runs and whitespace runs (so indentation becomes a few reusable tokens).
SPLIT_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# Directories that are not ordinary hand-written library code: IDLE, generated codec tables,
# the pydoc topic dump, third-party packages, caches, bundled wheels.
EXCLUDED_DIRS = frozenset(
    {"idlelib", "encodings", "pydoc_data", "site-packages", "dist-packages", "__pycache__", "_bundled"}
)
TEST_DIRS = frozenset({"test", "tests"})
MAX_FILE_BYTES = 400_000  # larger .py files in the stdlib are data, not code
HELD_OUT = 0.03  # fraction of files held out for the reported metrics
VALIDATION = 0.01  # fraction of files kept out of training to pick the checkpoint


@dataclass(frozen=True)
class Document:
    path: str  # relative to the stdlib root, POSIX separators
    text: str


def split_bucket(rel_path: str) -> float:
    """A file's fixed place in [0, 1): the first 8 bytes of the SHA-256 of its relative path."""
    return int.from_bytes(hashlib.sha256(rel_path.encode("utf-8")).digest()[:8], "big") / 2.0**64


def stdlib_documents(root: str | Path | None = None, include_tests: bool = True) -> list[Document]:
    """All stdlib .py files that are readable UTF-8 library (and, by default, test) code, sorted by path.

    The test suite is included because it is ordinary Python that more than doubles the distinct text a
    5M-parameter model can learn from; without it the model overfits well inside the time budget.
    """
    base = Path(root or sysconfig.get_paths()["stdlib"])
    excluded = EXCLUDED_DIRS if include_tests else EXCLUDED_DIRS | TEST_DIRS
    docs = []
    for f in sorted(base.rglob("*.py")):
        rel = f.relative_to(base)
        if excluded & set(rel.parts[:-1]) or not f.is_file() or f.stat().st_size > MAX_FILE_BYTES:
            continue
        try:
            text = f.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue  # deliberately mis-encoded test fixtures
        if text.strip():
            docs.append(Document(rel.as_posix(), text))
    return docs


def split_documents(
    docs: Sequence[Document], held_out: float = HELD_OUT, validation: float = VALIDATION
) -> tuple[list[Document], list[Document], list[Document]]:
    """(train, validation, held_out) by file: bucket < held_out -> held out (the reported metrics),
    held_out <= bucket < held_out + validation -> validation (checkpoint selection), the rest -> train."""
    train, val, held = [], [], []
    for d in docs:
        b = split_bucket(d.path)
        (held if b < held_out else val if b < held_out + validation else train).append(d)
    return train, val, held


def train_tokenizer(texts: Iterable[str], vocab_size: int) -> Tokenizer:
    """Byte-level BPE trained on `texts`, `vocab_size` ids in all; the ChatML markers (special) and the
    thinking / tool-call tags (plain added tokens, as in Qwen's and lumo.testing's tokenizers) come last."""
    n_added = len(SPECIAL_TOKENS) + len(ADDED_TOKENS)
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(SPLIT_PATTERN), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size - n_added,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        min_frequency=2,
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIAL_TOKENS])
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in ADDED_TOKENS])
    return tok


def encode_documents(tok: Tokenizer, docs: Sequence[Document]) -> torch.Tensor:
    """One token stream [N] int64: each document followed by <|endoftext|>."""
    eot = tok.token_to_id(EOT)
    encs = tok.encode_batch([d.text for d in docs], add_special_tokens=False)
    ids: list[int] = []
    for e in encs:
        ids.extend(e.ids)
        ids.append(eot)
    return torch.tensor(ids, dtype=torch.long)
