"""System and developer messages where clients put them: the family's official templates take one system
message, first ("System message must be at the beginning"), while Codex CLI sends developer messages, Claude
Code a system message after the user's, opencode and memory plugins a second system message. The rule
(chat.fold_system_messages): the ones before any other message are one system message, a later one a user
message where it stands. The Responses and Messages APIs apply it always; chat completions only when the
template refuses the messages as they are."""

from __future__ import annotations

import pytest

pytest.importorskip("fastapi")  # the GPU image has no fastapi/uvicorn; CI does

import anthropic

from lumo.engine.llm import embedded_model_path
from lumo.server.chat import render_prompt
from lumo.server.errors import APIError
from lumo.server.protocol import ChatCompletionRequest
from lumo.server.testing import scripted_server
from lumo.tokenizer import Tokenizer

MESSAGES = [
    {"role": "system", "content": "S1"},
    {"role": "developer", "content": "S2"},
    {"role": "user", "content": "U1"},
    {"role": "system", "content": "S3"},
    {"role": "user", "content": "U2"},
]
# a template that takes system messages anywhere (Qwen3's did)
PERMISSIVE = (
    "{%- for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{%- endfor %}"
    "{%- if add_generation_prompt %}<|im_start|>assistant\n{%- endif %}"
)


def test_chat_folds_only_what_the_template_refuses():
    tok = Tokenizer.from_dir(embedded_model_path())  # its template: a system message only first
    req = ChatCompletionRequest.model_validate({"messages": MESSAGES})
    prompt = render_prompt(tok, req)
    assert prompt.startswith("<|im_start|>system\nS1\n\nS2<|im_end|>\n<|im_start|>user\nU1<|im_end|>\n")
    assert "<|im_start|>user\nS3<|im_end|>\n<|im_start|>user\nU2" in prompt
    tok.set_chat_template("{{ raise_exception('no system here') }}")  # refused folded too: a 400
    with pytest.raises(APIError, match="no system here") as e:
        render_prompt(tok, req)
    assert e.value.status == 400 and e.value.param == "messages"
    tok.set_chat_template(PERMISSIVE)
    prompt = render_prompt(tok, req)  # as given (developer is the chat API's system)
    assert prompt.count("<|im_start|>system\n") == 3 and "<|im_start|>system\nS3<|im_end|>" in prompt


def test_the_messages_api_takes_system_messages_among_the_messages(tmp_path):
    """Claude Code 2.1.197's shape: a system message after the user's first message."""
    with scripted_server(tmp_path, "Hello.") as (llm, url):
        client = anthropic.Anthropic(base_url=url, api_key="x", max_retries=0)
        messages = [
            {"role": "user", "content": "U1"},
            {"role": "system", "content": "Agent types: Explore."},
            {"role": "assistant", "content": "A1"},
            {"role": "user", "content": "U2"},
        ]
        r = client.messages.create(model="any", max_tokens=20, system="S0", messages=messages)
        assert r.content[0].text == "Hello."
        prompt = llm.tokenizer.decode(llm.prompts[-1])
        assert prompt.startswith("<|im_start|>system\nS0<|im_end|>\n<|im_start|>user\nU1<|im_end|>\n")
        assert "<|im_start|>user\nAgent types: Explore.<|im_end|>\n<|im_start|>assistant\nA1" in prompt
        client.messages.create(
            model="any", max_tokens=20, messages=[{"role": "system", "content": "S"}, *messages]
        )
        assert llm.tokenizer.decode(llm.prompts[-1]).startswith("<|im_start|>system\nS<|im_end|>\n")


def test_chat_media_parts_are_notes():
    """Chat completions: an image, audio, file or video part is a note that it was left out, in its place
    among the text parts (Cline sends the image its read tool returned, then every later turn holds it: a
    400 ended its session), as the Responses and Messages APIs do; an unknown part is still a 400."""
    tok = Tokenizer.from_dir(embedded_model_path())
    parts = [
        {"type": "text", "text": "Look:"},
        {"type": "image_url", "image_url": {"url": "data:image/png;base64,iVBORw0KGgo="}},
        {"type": "input_audio", "input_audio": {"data": "UklGR", "format": "wav"}},
        {"type": "file", "file": {"file_id": "f1"}},
        {"type": "video_url", "video_url": {"url": "https://x/v.mp4"}},
        {"type": "text", "text": "What is it?"},
    ]
    req = ChatCompletionRequest.model_validate({"messages": [{"role": "user", "content": parts}]})
    notes = [
        f"[{w} was left out: this model reads text only]" for w in ("an image", "audio", "a file", "a video")
    ]
    assert "\n".join(["Look:", *notes, "What is it?"]) in render_prompt(tok, req)
    refusal = {"role": "assistant", "content": [{"type": "refusal", "refusal": "I cannot."}]}
    req = ChatCompletionRequest.model_validate({"messages": [{"role": "user", "content": "x"}, refusal]})
    assert "I cannot." in render_prompt(tok, req)  # an assistant's refusal part (OpenAI's) is its text
    bad = ChatCompletionRequest.model_validate(
        {"messages": [{"role": "user", "content": [{"type": "hologram"}]}]}
    )
    with pytest.raises(APIError, match="hologram") as e:
        render_prompt(tok, bad)
    assert e.value.status == 400 and e.value.param == "messages[0].content[0]"
