"""Tokenizer: `tokenizers` for text <-> ids, jinja2 for the chat template, and an incremental detokenizer.

The chat template is rendered the way transformers renders it (sandboxed jinja2, trim_blocks/lstrip_blocks,
`raise_exception`, a `tojson` that does not HTML-escape, the loopcontrols extension), so a checkpoint's own
template gives byte-identical prompts in lumo and in transformers.
"""

from __future__ import annotations

import functools
import json
import os
import re
from collections.abc import Sequence
from datetime import datetime
from pathlib import Path
from typing import Any

import jinja2
import jinja2.ext
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer as _HFTokenizer
from tokenizers import decoders as _decoders

REPLACEMENT_CHAR = "\ufffd"  # what a byte-level decoder emits for an incomplete UTF-8 sequence


class TokenizerError(ValueError):
    """A tokenizer or chat template lumo cannot use; the message is one line meant for the user."""


# ---------------------------------------------------------------------------------------------
# Chat templates


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(
    x: Any, ensure_ascii: bool = False, indent: int | None = None, separators=None, sort_keys=False
) -> str:
    # jinja's own tojson HTML-escapes '<', '>', '&' and "'", which would change the prompt the model sees
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def _compile_template(source: str) -> jinja2.Template:
    # Templates from the Hub are untrusted code: the immutable sandbox stops attribute escapes and mutation
    # of the caller's messages.
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    try:
        return env.from_string(source)
    except jinja2.TemplateSyntaxError as e:
        raise TokenizerError(f"chat template does not compile: {e.message} (line {e.lineno})") from None


def read_chat_template(template: str | os.PathLike) -> str:
    """A chat template given as a file's path or as the jinja text itself (vLLM's --chat-template), checked
    to compile."""
    text = str(template)
    try:
        is_file = Path(text).expanduser().is_file()
    except (OSError, ValueError):  # a template's text can be too long or odd for a path
        is_file = False
    if is_file:
        try:
            text = Path(text).expanduser().read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as e:
            raise TokenizerError(f"cannot read the chat template {template}: {e}") from None
    elif "{{" not in text and "{%" not in text:
        raise TokenizerError(f"chat template {text!r}: no such file, and not a jinja template either")
    _compile_template(text)
    return text


def _token_content(tok: Any) -> str | None:
    # tokenizer_config.json writes special tokens either as a string or as an AddedToken dict
    if isinstance(tok, dict):
        return tok.get("content")
    return tok if isinstance(tok, str) else None


def _as_ids(v: Any, where: str) -> tuple[int, ...]:
    """An eos_token_id field (an integer or a list of them; null: none), checked: `where` names it."""
    if v is None:
        return ()
    ids = v if isinstance(v, list) else [v]
    if any(isinstance(x, bool) or not isinstance(x, int) or x < 0 for x in ids):
        raise TokenizerError(f"{where}: eos_token_id must be a token id or a list of them, got {v!r}")
    return tuple(ids)


def _byte_level_alphabet() -> dict[int, str]:
    """Byte -> character of byte-level BPE vocabularies (GPT-2's table, used by Qwen): printable Latin-1
    bytes stand for themselves, the other 68 for U+0100 onwards in byte order."""
    keep = [*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    rest = [b for b in range(256) if b not in keep]
    return {**{b: chr(b) for b in keep}, **{b: chr(0x100 + i) for i, b in enumerate(rest)}}


_BYTE_FALLBACK = re.compile(r"<0x([0-9A-Fa-f]{2})>")  # sentencepiece-style byte tokens


def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    try:
        d = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise TokenizerError(f"{path} is not valid JSON: {e}") from None
    if not isinstance(d, dict):
        raise TokenizerError(f"{path} must hold a JSON object, got {type(d).__name__}")
    return d


class Tokenizer:
    """Text <-> token ids for one checkpoint, with its chat template and end-of-sequence ids."""

    def __init__(
        self,
        tok: _HFTokenizer,
        chat_templates: dict[str, str] | None = None,
        eos_token_ids: Sequence[int] = (),
        special_tokens: dict[str, str] | None = None,
    ) -> None:
        self._tok = tok
        self._templates = dict(chat_templates or {})  # name -> jinja source; "default" is the usual one
        self.eos_token_ids: tuple[int, ...] = tuple(eos_token_ids)
        # bos_token / eos_token / pad_token / unk_token strings, handed to the template like transformers does
        self.special_tokens: dict[str, str] = dict(special_tokens or {})
        self._compiled: dict[str, jinja2.Template] = {}  # template name -> compiled, built on first use
        # the weights' vocabulary (config.json vocab_size), set by the LLM that loads them: `encode` refuses
        # text holding an id the weights lack (a checkpoint whose tokenizer does not match its weights)
        self.model_vocab: int | None = None

    @classmethod
    def from_dir(cls, path: str | Path) -> Tokenizer:
        path = Path(path)
        tj = path / "tokenizer.json"
        if not tj.is_file():
            raise TokenizerError(
                f"no tokenizer.json in {path}; lumo needs a fast (tokenizers) tokenizer file"
            )
        try:
            tok = _HFTokenizer.from_file(str(tj))
        except Exception as e:  # tokenizers raises a bare Exception on a malformed file
            raise TokenizerError(f"cannot read {tj}: {e}") from None
        tcfg = _read_json(path / "tokenizer_config.json")

        templates: dict[str, str] = {}
        ct = tcfg.get("chat_template")
        named = isinstance(ct, list) and all(
            isinstance(t, dict) and isinstance(t.get("name"), str) and isinstance(t.get("template"), str)
            for t in ct
        )
        if isinstance(ct, str):
            templates["default"] = ct
        elif named:
            templates.update({t["name"]: t["template"] for t in ct})
        elif ct is not None:
            raise TokenizerError(
                f"{path / 'tokenizer_config.json'}: chat_template must be a string or a list of "
                '{"name": ..., "template": ...} objects with string values'
            )
        # transformers saves the default template as its own file nowadays; it wins over tokenizer_config.json
        jinja_file = path / "chat_template.jinja"
        if jinja_file.is_file():
            try:
                templates["default"] = jinja_file.read_text(encoding="utf-8")
            except UnicodeDecodeError as e:
                raise TokenizerError(f"{jinja_file} is not valid UTF-8 text ({e})") from None

        special = {
            k: s
            for k in ("bos_token", "eos_token", "pad_token", "unk_token")
            if (s := _token_content(tcfg.get(k))) is not None
        }
        eos = cls._find_eos(path, tok, special.get("eos_token"))
        return cls(tok, templates, eos, special)

    @staticmethod
    def _find_eos(path: Path, tok: _HFTokenizer, eos_token: str | None) -> tuple[int, ...]:
        # generation_config.json is what generate() obeys; config.json (or its text_config) next; the
        # tokenizer's own eos token last.
        gen = path / "generation_config.json"
        if ids := _as_ids(_read_json(gen).get("eos_token_id"), gen.name):
            return ids
        cfg = _read_json(path / "config.json")
        text_cfg = cfg.get("text_config") if isinstance(cfg.get("text_config"), dict) else {}
        if ids := _as_ids(cfg.get("eos_token_id", text_cfg.get("eos_token_id")), "config.json"):
            return ids
        if eos_token is not None and (i := tok.token_to_id(eos_token)) is not None:
            return (i,)
        return ()

    # ---- ids ----
    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, check: bool = True) -> list[int]:
        """The text's ids. check=False: ids past `model_vocab` too (counting tokens, not feeding them)."""
        # add_special_tokens=False: no BOS/EOS post-processing; the chat template writes any markers itself.
        # encode_batch, because it releases the GIL while it works (encode does not): a long prompt
        # tokenised in a server worker thread must not stall the event loop.
        if not text.isascii():
            try:
                text.encode("utf-8")
            except UnicodeEncodeError as e:  # a lone UTF-16 surrogate, e.g. from a JSON "\ud800"
                raise TokenizerError(
                    f"the text is not valid Unicode: lone surrogate U+{ord(text[e.start]):04X} at "
                    f"character {e.start}"
                ) from None
        ids = self._tok.encode_batch([text], add_special_tokens=False)[0].ids
        if check and self.model_vocab is not None and ids and (top := max(ids)) >= self.model_vocab:
            raise TokenizerError(
                f"the text holds the token {self._tok.id_to_token(top)!r} (id {top}), past the model's "
                f"vocabulary of {self.model_vocab} ids (config.json vocab_size): this checkpoint's tokenizer "
                "does not match its weights"
            )
        return ids

    @functools.cached_property
    def max_token_chars(self) -> int:
        """Characters of the longest token string in the vocabulary: a token never covers more characters
        of (normalised) text than that."""
        return max(map(len, self._tok.get_vocab(with_added_tokens=True)), default=1)

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = False) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def added_token_ids(self) -> tuple[int, ...]:
        """Ids of the tokenizer's added tokens (end of text, chat and reasoning / tool markers), ascending."""
        return tuple(sorted(self._tok.get_added_tokens_decoder()))

    def token_to_id(self, s: str) -> int | None:
        return self._tok.token_to_id(s)

    def _template_name(self, tools: bool) -> str:
        return "tool_use" if tools and "tool_use" in self._templates else "default"

    def chat_template_source(self, tools: bool = False) -> str | None:
        """The jinja source apply_chat_template renders with (with tools or without), None if none."""
        return self._templates.get(self._template_name(tools))

    def to_json(self) -> str:
        """The tokenizer as tokenizer.json text (what llguidance reads: lumo.engine.grammar)."""
        return self._tok.to_str()

    def id_to_token(self, i: int) -> str | None:
        return self._tok.id_to_token(i)

    @functools.cached_property
    def _byte_of_char(self) -> dict[str, int] | None:
        if not isinstance(self._tok.decoder, _decoders.ByteLevel):
            return None
        return {c: b for b, c in _byte_level_alphabet().items()}

    @functools.cached_property
    def _added_content(self) -> dict[int, str]:
        return {i: t.content for i, t in self._tok.get_added_tokens_decoder().items()}

    def token_bytes(self, i: int) -> bytes:
        """The bytes token i stands for (a byte-level token may hold part of a UTF-8 character)."""
        if (added := self._added_content.get(i)) is not None:
            return added.encode()
        s = self._tok.id_to_token(i)
        if s is None:
            return b""
        table = self._byte_of_char
        if table is not None and all(c in table for c in s):
            return bytes(table[c] for c in s)
        if m := _BYTE_FALLBACK.fullmatch(s):
            return bytes([int(m.group(1), 16)])
        return s.replace("\u2581", " ").encode()  # sentencepiece's word marker

    def token_text(self, i: int) -> str:
        """Token i alone as text (U+FFFD where it holds part of a UTF-8 character)."""
        return self.token_bytes(i).decode("utf-8", errors="replace")

    # ---- chat ----
    @property
    def has_chat_template(self) -> bool:
        return bool(self._templates)

    def set_chat_template(self, source: str) -> None:
        """Render every chat (with tools or without) with `source` instead of the checkpoint's templates."""
        self._templates = {"default": source}
        self._compiled.clear()

    def apply_chat_template(
        self,
        messages: list[dict[str, Any]],
        tools: list[dict[str, Any]] | None = None,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        **kwargs: Any,
    ) -> str:
        """Render `messages` to the prompt text; extra kwargs (e.g. enable_thinking) reach the template.
        continue_final_message: the text ends where the last message's content does (no end-of-turn
        after it), so the model continues that message (a prefilled reply); not with add_generation_prompt.
        The content is rendered with a marker after it and the text cut there (however the template
        renders it; trailing whitespace and an empty content stay as given); a template that drops or
        repeats the marker falls back to the content's last occurrence in the plain rendering.
        """
        if continue_final_message:
            if add_generation_prompt:
                raise TokenizerError("continue_final_message and add_generation_prompt exclude each other")
            if not messages or not isinstance(messages[-1].get("content"), str):
                raise TokenizerError("continue_final_message needs a last message with text content")
            final = messages[-1]["content"]
            marked = [*messages[:-1], {**messages[-1], "content": final + _CONTINUE_MARK}]
            text = self.apply_chat_template(marked, tools, False, **kwargs)
            at = text.find(_CONTINUE_MARK)
            if at >= 0 and text.count(_CONTINUE_MARK) == 1:  # where the (rendered) content ended
                return text[:at]
            return _cut_after_final(self.apply_chat_template(messages, tools, False, **kwargs), final)
        name = self._template_name(bool(tools))
        source = self._templates.get(name)
        if source is None:
            if not self._templates:
                raise TokenizerError("this checkpoint has no chat template; send a plain prompt instead")
            raise TokenizerError(f"no 'default' chat template among {sorted(self._templates)}")
        if (template := self._compiled.get(name)) is None:
            template = self._compiled[name] = _compile_template(source)
        ctx = {**self.special_tokens, **kwargs}
        names = _reasoning_names(source)
        messages = [_reasoning_as(m, names) for m in messages]
        try:
            return template.render(
                messages=messages, tools=tools, add_generation_prompt=add_generation_prompt, **ctx
            )
        except jinja2.TemplateError as e:
            raise TokenizerError(f"chat template error: {e}") from None


_CONTINUE_MARK = "\ue000lumo:continue\ue000"  # private-use characters: no template or text has them


# An assistant turn's reasoning has two names: `reasoning_content` (DeepSeek's, which Qwen's templates read)
# and `reasoning` (vLLM's since late 2025). A template reads it as `message.reasoning`, `message['reasoning']`
# or `message.get('reasoning')`; `reasoning_content` anywhere in it is the other name.
_READS_REASONING = re.compile(r"""[.\[(]\s*['"]?reasoning\b""")


@functools.lru_cache(maxsize=16)
def _reasoning_names(source: str) -> tuple[str, ...]:
    """The names of the reasoning that a chat template reads."""
    return tuple(
        name
        for name, reads in (
            ("reasoning_content", "reasoning_content" in source),
            ("reasoning", _READS_REASONING.search(source) is not None),
        )
        if reads
    )


def _reasoning_as(message: Any, names: tuple[str, ...]) -> Any:
    """The message with its reasoning (under either name; `reasoning_content` first if both differ) under
    the names the template reads, and not under the others; as given if the template reads neither (one
    that lists a message's keys renders it once)."""
    if not isinstance(message, dict) or not names:
        return message
    text = message.get("reasoning_content") or message.get("reasoning")
    if not text:
        return message
    rest = {k: v for k, v in message.items() if k not in ("reasoning_content", "reasoning")}
    return {**rest, **dict.fromkeys(names, text)}


def _cut_after_final(text: str, final: str) -> str:
    """`text` up to the end of its last occurrence of the final message's content (as rendered: the
    template may have stripped its surrounding whitespace)."""
    for piece in (final, final.strip()):
        if piece and (at := text.rfind(piece)) >= 0:
            return text[: at + len(piece)]
    raise TokenizerError("continue_final_message: the chat template does not render the last message's text")


# ---------------------------------------------------------------------------------------------
# Incremental detokenization


class IncrementalDetokenizer:
    """Turns a stream of token ids into text that is safe to send: whole characters, nothing of a stop
    string (or, with include_stop, the text up to the end of the first stop string).

    Decodes only a window of recent tokens (vLLM's prefix_offset/read_offset): `tokens[prefix_offset:
    read_offset]` is text already emitted, kept as context because some decoders (SentencePiece
    spaces) render a token differently at the start of a string; the text after it is the new part.
    """

    def __init__(
        self,
        tokenizer: Tokenizer,
        stop: list[str] | None = None,
        skip_special_tokens: bool = True,
        prompt_ids: Sequence[int] = (),
        include_stop: bool = False,
        min_tokens: int = 0,
    ) -> None:
        self._tok = tokenizer
        self._stop = [s for s in (stop or []) if s]
        self._include_stop = include_stop
        # vLLM's min_tokens: stop strings are looked for only once that many tokens were added (in the text
        # from then on: text emitted before cannot be held back)
        self._min_tokens, self._added = min_tokens, 0
        self._max_hold = max((len(s) for s in self._stop), default=1) - 1  # longest partial stop kept back
        self._skip = skip_special_tokens
        # a few prompt tokens give the first generated token its left context
        self._ids: list[int] = list(prompt_ids[-6:])
        self._prefix_offset = max(len(self._ids) - 5, 0)
        self._read_offset = len(self._ids)
        self._pending = ""  # decoded, whole characters, not yet emitted (could start a stop string)
        self._out: list[str] = []
        self.stopped = False
        self.stop_string: str | None = None  # the stop string that ended the text

    @property
    def text(self) -> str:
        return "".join(self._out)

    def add(self, token_id: int) -> str:
        """Feed one token; return the text that became final with it ("" when nothing did)."""
        if self.stopped:
            return ""
        self._ids.append(int(token_id))
        self._added += 1
        self._pending += self._decode_new(final=False)
        return self._emit(final=False)

    def finish(self) -> str:
        """End of stream: flush what was held back (an incomplete character is flushed as U+FFFD)."""
        if self.stopped:
            return ""
        self._pending += self._decode_new(final=True)
        return self._emit(final=True)

    def _decode_new(self, final: bool) -> str:
        ids = self._ids
        if self._read_offset == len(ids):
            return ""
        prefix = self._tok.decode(ids[self._prefix_offset : self._read_offset], self._skip)
        full = self._tok.decode(ids[self._prefix_offset :], self._skip)
        # A trailing U+FFFD means the last tokens end inside a multi-byte character: wait for more bytes.
        if not final and (len(full) <= len(prefix) or full.endswith(REPLACEMENT_CHAR)):
            return ""
        self._prefix_offset, self._read_offset = self._read_offset, len(ids)
        return full[len(prefix) :]

    def _emit(self, final: bool) -> str:
        text = self._pending
        if self._added < self._min_tokens:
            self._pending = ""
            self._out.append(text)
            return text
        # the first stop string in the text (the longest of those starting there)
        cut, end, which = min(
            ((i, -len(s), s) for s in self._stop if (i := text.find(s)) >= 0), default=(-1, 0, None)
        )
        if cut >= 0:
            self.stopped, self.stop_string = True, which
            out, self._pending = text[: cut - end if self._include_stop else cut], ""
        else:
            hold = 0 if final else self._stop_prefix_len(text)
            out, self._pending = text[: len(text) - hold], text[len(text) - hold :]
        self._out.append(out)
        return out

    def _stop_prefix_len(self, text: str) -> int:
        # Longest suffix of `text` that is a proper prefix of a stop string. Text before it can never be
        # part of a stop string, so it is safe to emit; the suffix waits for the next token.
        for n in range(min(len(text), self._max_hold), 0, -1):
            tail = text[-n:]
            if any(s.startswith(tail) for s in self._stop):
                return n
        return 0
