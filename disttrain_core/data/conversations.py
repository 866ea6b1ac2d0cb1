"""Conversations (LLaVA's instruction format) rendered with a chat template, the loss on the assistant's turns only.

A sample's ``json`` holds ``{"conversations": [{"from": "human", "value": "<image>\\nWhat is this?"},
{"from": "gpt", "value": "A cat."}, ...]}`` (``from``: human | gpt | system; ``role``/``content`` keys are read
too), its image a member of the sample as in the caption layout. ``<image>`` in a turn marks where the image
goes; a conversation that has an image but no ``<image>`` gets it at the start of its first human turn (as
LLaVA's data loader does).

The template is Jinja, as transformers renders ``tokenizer_config.json``'s ``chat_template``: ``messages``
(role user | assistant | system, content), ``add_generation_prompt``, ``bos_token``, ``eos_token``,
``raise_exception``, in a sandboxed environment. ``data.chat_template``: ``auto`` (the tokenizer's
``tokenizer_config.json``, else ``vicuna``), a built-in name (``TEMPLATES``), or the path of a ``.jinja`` file.

Rendering: each message's content is replaced by a marker, the template rendered once for the whole
conversation and once per assistant turn for the conversation up to it; the text around the markers is the
template's (tokenized with its special tokens, ``encode_template``), the contents are the data's (tokenized as
plain text, ``encode``: a user cannot type a special token). An assistant turn's loss covers its content and the
template's text that closes it (``<|im_end|>\\n``, ``</s>``): what the conversation up to that turn ends with
after the content. Contents are stripped of surrounding whitespace (Llama 3's template trims them); ``bos_token``
renders empty (the row starts with ``<bos>`` already) and ``eos_token`` as the tokenizer's ``<eos>`` id.
"""

from __future__ import annotations

import functools
import json
from pathlib import Path

from .bad_sample import BadSample

IMAGE_MARK = "<image>"
ROLES = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant", "system": "system"}
TEMPLATES = {
    # LLaVA v1's Vicuna format: "USER: ... ASSISTANT: ...</s>"
    "vicuna": (
        "{% for m in messages %}{% if m.role == 'system' %}{{ m.content }} {% elif m.role == 'user' %}USER: "
        "{{ m.content }} {% else %}ASSISTANT: {{ m.content }}{{ eos_token }}{% endif %}{% endfor %}"
        "{% if add_generation_prompt %}ASSISTANT:{% endif %}"
    ),
    # Qwen's ChatML
    "chatml": (
        "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
        "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    ),
    "llama3": (
        "{{ bos_token }}{% for m in messages %}<|start_header_id|>{{ m.role }}<|end_header_id|>\n\n"
        "{{ m.content | trim }}<|eot_id|>{% endfor %}"
        "{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}"
    ),
}
_MARK = "\x00dt-message-{}\x00"
_EOS = "\x00dt-eos\x00"


def messages_of(record: dict) -> list[dict[str, str]]:
    """``[{"role", "content"}]`` of a LLaVA-style record; BadSample when malformed or without an assistant turn."""
    turns = record.get("conversations", record.get("messages"))
    if not isinstance(turns, list) or not turns:
        raise BadSample("bad_conversation", "conversations must be a non-empty list")
    messages = []
    for turn in turns:
        if not isinstance(turn, dict):
            raise BadSample("bad_conversation", f"a turn is {type(turn).__name__}, not an object")
        speaker = turn.get("from", turn.get("role"))
        content = turn.get("value", turn.get("content"))
        if speaker not in ROLES or not isinstance(content, str):
            raise BadSample("bad_conversation", f"a turn from {speaker!r}: want from human|gpt|system and a text value")
        messages.append({"role": ROLES[speaker], "content": content.strip()})
    if not any(m["role"] == "assistant" for m in messages):
        raise BadSample("no_assistant_turn", "the conversation has no gpt/assistant turn to learn from")
    return messages


@functools.lru_cache(maxsize=8)
def compiled(source: str):
    from jinja2.exceptions import TemplateError
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message):
        raise TemplateError(message)

    environment = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"]
    )
    environment.globals["raise_exception"] = raise_exception
    return environment.from_string(source)


def template_source(name: str, tokenizer_name: str) -> str:
    """The Jinja text of ``data.chat_template`` (``auto``: the tokenizer's, else vicuna). ValueError in one line."""
    if name in TEMPLATES:
        return TEMPLATES[name]
    if name == "auto":
        config = Path(tokenizer_name)
        config = (config if config.is_dir() else config.parent) / "tokenizer_config.json"
        if tokenizer_name != "byte" and config.is_file():
            template = json.loads(config.read_text()).get("chat_template")
            if isinstance(template, list):  # transformers' named templates: the default one
                template = next((t["template"] for t in template if t.get("name") == "default"), None)
            if isinstance(template, str):
                return template
        return TEMPLATES["vicuna"]
    path = Path(name)
    if path.suffix == ".jinja" and path.is_file():
        return path.read_text()
    raise ValueError(
        f"data.chat_template={name}: use auto (the tokenizer's tokenizer_config.json, else vicuna), one of "
        f"{', '.join(TEMPLATES)}, or the path of a .jinja file"
    )


def _render(source: str, messages: list[dict], generation_prompt: bool) -> str:
    from jinja2.exceptions import TemplateError

    marked = [{"role": m["role"], "content": _MARK.format(i)} for i, m in enumerate(messages)]
    try:
        return compiled(source).render(
            messages=marked, add_generation_prompt=generation_prompt, bos_token="", eos_token=_EOS
        )
    except TemplateError as error:
        raise BadSample("chat_template", str(error)) from None


def render_pieces(source: str, messages: list[dict]) -> list[tuple[str, str, bool]]:
    """The conversation as ``(kind, text, trained)`` pieces in order: kind ``template`` (the template's text),
    ``content`` (a message's text, with ``<image>`` marks) or ``eos``; trained: the loss is taken on it."""
    full = _render(source, messages, False)
    closing: dict[int, int] = {}  # assistant message -> characters of template text after it that close its turn
    for i, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        upto = _render(source, messages[: i + 1], False)
        if not full.startswith(upto):
            raise BadSample("chat_template", "the template renders a conversation's start differently when it goes on")
        closing[i] = len(upto) - (upto.index(_MARK.format(i)) + len(_MARK.format(i)))
    pieces: list[tuple[str, str, bool]] = []
    rest = full
    for i, message in enumerate(messages):
        mark = _MARK.format(i)
        if mark not in rest:
            raise BadSample("chat_template", f"the template left out message {i} ({message['role']})")
        before, rest = rest.split(mark, 1)
        pieces.append(("template", before, False))
        trained = message["role"] == "assistant"
        pieces.append(("content", message["content"], trained))
        if trained:
            pieces.append(("template", rest[: closing[i]], True))
            rest = rest[closing[i] :]
    pieces.append(("template", rest, False))
    out: list[tuple[str, str, bool]] = []
    for kind, text, trained in pieces:  # the eos sentinel becomes its own piece
        parts = text.split(_EOS) if kind == "template" else [text]
        for k, part in enumerate(parts):
            if k:
                out.append(("eos", "", trained))
            if part:
                out.append((kind, part, trained))
    return out


def place_images(messages: list[dict], images: int) -> list[dict]:
    """Give a conversation with images but no ``<image>`` mark one at the start of its first user turn; check the
    marks do not outnumber the images."""
    marks = sum(m["content"].count(IMAGE_MARK) for m in messages)
    if images and not marks:
        first = next((i for i, m in enumerate(messages) if m["role"] == "user"), 0)
        messages = [dict(m) for m in messages]
        messages[first]["content"] = f"{IMAGE_MARK}\n{messages[first]['content']}"
        marks = 1
    if marks > images:
        raise BadSample("missing_image", f"{marks} <image> marks but {images} image member(s)")
    return messages
