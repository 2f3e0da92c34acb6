"""Conversations: normalise every input shape, apply the target's chat template, build loss_mask.

Input records come in three shapes (all normalised by ``normalize_record``):

- OpenAI: ``{"messages": [{"role": "system"|"user"|"assistant", "content": str | [text parts]}]}``
- ShareGPT: ``{"conversations": [{"from": "system"|"human"|"gpt"|..., "value": str}]}``
- plain text already templated: ``{"text": "<|im_start|>user..."}``

``tokenize_conversation`` renders messages with the tokenizer's own chat template (the one
serving uses) and sets loss_mask = 1 on exactly what the target generates when served: each
assistant turn's content and its end-of-turn token, optionally without its ``<think>`` block.
It needs no ``{% generation %}`` markers: for assistant turn i it renders ``messages[:i]`` with
the generation prompt; when that text is a prefix of the full rendering, the response starts
right after it (this is exactly the serving-time prompt, so e.g. Qwen3's empty think block in
non-thinking mode stays unsupervised). Templates that render history differently from the
serving prompt (Qwen3 drops reasoning from earlier turns) fall back to the assistant header
the template emits, found by probing the template once. The turn ends with the first
end-of-turn token after the start (probed too: the first special token after an assistant
reply). Character spans map to tokens through the fast tokenizer's offsets. When the template
does carry generation markers, the tokenizer's own assistant mask is computed as well and the
two must agree (else the sample is rejected with reason ``mask_mismatch``).

Every problem with one sample raises ``SampleError`` with a short ``reason`` code (counted in
prepare's summary) and a message naming the fix.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

import numpy as np

ROLE_ALIASES = {
    "system": "system",
    "user": "user", "human": "user",
    "assistant": "assistant", "gpt": "assistant", "model": "assistant", "chatgpt": "assistant", "bot": "assistant",
}
THINK_OPEN, THINK_CLOSE = "<think>", "</think>"
_GENERATION_MARKER = re.compile(r"{%-?\s*generation\s*-?%}")


class SampleError(ValueError):
    """One sample cannot be used. ``reason`` is a short code (bad_json, unknown_role, ...)."""

    def __init__(self, reason: str, message: str):
        super().__init__(message)
        self.reason = reason


def _content_text(content: Any, where: str) -> str:
    if isinstance(content, str):
        return content
    if content is None:
        return ""
    if isinstance(content, list):  # OpenAI content parts; only text is meaningful to a text drafter
        parts = []
        for part in content:
            if isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str):
                parts.append(part["text"])
            else:
                raise SampleError("bad_shape", f"{where}: content part {part!r} is not a text part")
        return "".join(parts)
    raise SampleError("bad_shape", f"{where}: content must be a string or a list of text parts, "
                                   f"got {type(content).__name__}")


def normalize_messages(turns: Any, where: str = "sample", *, require_final_assistant: bool = True) -> list[dict]:
    """OpenAI or ShareGPT turns -> ``[{"role": system|user|assistant, "content": str}, ...]``.

    ``reasoning_content`` of assistant turns is kept (chat templates such as Qwen3's read it).
    Raises ``SampleError``: unknown_role, empty_assistant, no_assistant, ends_with_user (when
    ``require_final_assistant``: trailing prompts carry no supervision), bad_shape.
    """
    if not isinstance(turns, list) or not turns:
        raise SampleError("bad_shape", f"{where}: messages must be a non-empty list")
    out = []
    for k, turn in enumerate(turns):
        if not isinstance(turn, dict):
            raise SampleError("bad_shape", f"{where}: turn {k} is a {type(turn).__name__}, expected an object")
        raw_role = turn.get("role", turn.get("from"))
        role = ROLE_ALIASES.get(str(raw_role).lower()) if raw_role is not None else None
        if role is None:
            raise SampleError("unknown_role", f"{where}: turn {k} has unknown role {raw_role!r}; "
                                              f"use one of {sorted(ROLE_ALIASES)}")
        content = _content_text(turn["content"] if "content" in turn else turn.get("value"), f"{where}: turn {k}")
        message = {"role": role, "content": content}
        if role == "assistant":
            reasoning = turn.get("reasoning_content")
            if isinstance(reasoning, str) and reasoning:
                message["reasoning_content"] = reasoning
            if require_final_assistant and not content.strip() and not message.get("reasoning_content"):
                raise SampleError("empty_assistant", f"{where}: assistant turn {k} is empty; drop the turn or "
                                                     "regenerate it with `flashdraft regenerate`")
        out.append(message)
    if require_final_assistant:
        if not any(m["role"] == "assistant" for m in out):
            raise SampleError("no_assistant", f"{where}: no assistant turn, nothing to supervise; "
                                              "generate replies with `flashdraft regenerate`")
        if out[-1]["role"] != "assistant":
            raise SampleError("ends_with_user", f"{where}: the conversation ends with a {out[-1]['role']} turn; "
                                                "remove it or generate the reply with `flashdraft regenerate`")
    return out


def normalize_record(record: Any, where: str = "sample", *, require_final_assistant: bool = True) -> dict:
    """One input record -> ``{"messages": [...]}`` or ``{"text": str}``. Raises ``SampleError``."""
    if not isinstance(record, dict):
        raise SampleError("bad_shape", f"{where}: expected a JSON object, got {type(record).__name__}")
    for key in ("messages", "conversations", "conversation"):
        if record.get(key) is not None:
            return {"messages": normalize_messages(record[key], where, require_final_assistant=require_final_assistant)}
    if isinstance(record.get("text"), str):
        if not record["text"].strip():
            raise SampleError("bad_shape", f"{where}: empty text")
        return {"text": record["text"]}
    raise SampleError("bad_shape", f"{where}: no 'messages' (OpenAI), 'conversations' (ShareGPT) or 'text' field; "
                                   f"found keys {sorted(record)[:8]}")


@dataclass(frozen=True)
class TemplateInfo:
    """What probing the chat template found (once per tokenizer and thinking mode)."""

    header: str  # text the template emits before an assistant reply ('' if it has no generation prompt)
    end_of_turn: str  # the token that ends an assistant turn (e.g. <|im_end|>, <|eot_id|>)
    nothink_prefix: str  # extra generation-prompt text in non-thinking mode (Qwen3: empty think block)
    has_generation_markers: bool  # template wraps assistant output in {% generation %}
    template_kwargs: tuple  # extra template variables, e.g. (("enable_thinking", False),)


def render(tokenizer, messages: list[dict], *, add_generation_prompt: bool = False, template_kwargs=()) -> str:
    """The chat template applied to ``messages`` as text (no tokenization)."""
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt,
                                         **dict(template_kwargs))


def probe_template(tokenizer, enable_thinking: bool | None = None) -> TemplateInfo:
    """Find the assistant header and end-of-turn token of ``tokenizer``'s chat template.

    ``enable_thinking`` None leaves the template's default; True/False is passed to the
    template as ``enable_thinking`` (Qwen3 convention), as serving engines do.
    """
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError("the tokenizer has no chat_template; use a chat (instruct) tokenizer, or give "
                         "already-templated {'text': ...} records")
    kwargs = () if enable_thinking is None else (("enable_thinking", bool(enable_thinking)),)
    user = [{"role": "user", "content": "Probe question"}]
    base = render(tokenizer, user)
    with_prompt = render(tokenizer, user, add_generation_prompt=True)
    header = with_prompt[len(base):] if with_prompt.startswith(base) else ""
    nothink = render(tokenizer, user, add_generation_prompt=True, template_kwargs=(("enable_thinking", False),))
    nothink_prefix = nothink[len(with_prompt):] if nothink.startswith(with_prompt) else ""
    reply = "Probe answer"
    chat = render(tokenizer, user + [{"role": "assistant", "content": reply}], template_kwargs=kwargs)
    tail = chat[chat.rfind(reply) + len(reply):]
    end_of_turn = ""
    special = set(tokenizer.all_special_tokens)
    for token in tokenizer.backend_tokenizer.encode(tail, add_special_tokens=False).tokens:
        if token in special:
            end_of_turn = token
            break
    if not end_of_turn:
        end_of_turn = tokenizer.eos_token or ""
    if not end_of_turn or end_of_turn not in tail:
        raise ValueError(f"cannot find the end-of-turn token after an assistant reply in the chat template (text "
                         f"after the reply: {tail!r}); the template must end assistant turns with a special token")
    markers = bool(_GENERATION_MARKER.search(tokenizer.chat_template if isinstance(tokenizer.chat_template, str)
                                             else ""))
    return TemplateInfo(header, end_of_turn, nothink_prefix, markers, kwargs)


def _turn_end(text: str, start: int, info: TemplateInfo, where: str) -> int:
    e = text.find(info.end_of_turn, start)
    if e < 0:
        raise SampleError("template_mismatch", f"{where}: no {info.end_of_turn!r} after an assistant turn")
    return e + len(info.end_of_turn)


def _skip_nothink(text: str, start: int, info: TemplateInfo) -> int:
    # In non-thinking mode the empty think block belongs to the serving prompt, not the reply.
    if info.nothink_prefix and dict(info.template_kwargs).get("enable_thinking") is False \
            and text.startswith(info.nothink_prefix, start):
        return start + len(info.nothink_prefix)
    return start


def assistant_spans(tokenizer, messages: list[dict], info: TemplateInfo, where: str = "sample") -> tuple[str, list]:
    """Render ``messages`` and return (text, [(start, end) character span of each assistant reply])."""
    full = render(tokenizer, messages, template_kwargs=info.template_kwargs)
    spans, cursor = [], 0
    for i, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        prompt = render(tokenizer, messages[:i], add_generation_prompt=True, template_kwargs=info.template_kwargs)
        if len(prompt) >= cursor and full.startswith(prompt):
            start = len(prompt)  # the exact serving-time prompt precedes this reply
        else:
            j = full.find(info.header, cursor) if info.header else -1
            if j < 0:
                raise SampleError("template_mismatch", f"{where}: assistant turn {i} is not where the chat template's "
                                                       "generation prompt puts it, and no assistant header was found")
            start = _skip_nothink(full, j + len(info.header), info)
        end = _turn_end(full, start, info, where)
        spans.append((start, end))
        cursor = end
    return full, spans


def text_spans(text: str, info: TemplateInfo, where: str = "sample") -> list:
    """Assistant reply spans of already-templated text, found by the template's header and end-of-turn."""
    if not info.header:
        raise SampleError("template_mismatch", f"{where}: the chat template has no generation prompt, so assistant "
                                               "turns cannot be located in plain text; give messages instead")
    spans, cursor = [], 0
    while True:
        j = text.find(info.header, cursor)
        if j < 0:
            break
        start = _skip_nothink(text, j + len(info.header), info)
        end = _turn_end(text, start, info, where)
        spans.append((start, end))
        cursor = end
    if not spans:
        raise SampleError("no_assistant", f"{where}: no assistant turn ({info.header!r}) in the text")
    return spans


def _reasoning(reply: str) -> str:
    """The text inside a reply's leading <think> block ('' if none)."""
    body = reply.lstrip()
    if not body.startswith(THINK_OPEN):
        return ""
    return body[len(THINK_OPEN):].split(THINK_CLOSE)[0].strip()


def drop_thinking(text: str, spans: list) -> list:
    """Remove each span's leading ``<think>...</think>`` block (and the whitespace after it)."""
    out = []
    for start, end in spans:
        body = text[start:end]
        lead = len(body) - len(body.lstrip())
        if body.startswith(THINK_OPEN, lead):
            close = body.find(THINK_CLOSE, lead)
            cut = end if close < 0 else start + close + len(THINK_CLOSE)
            while cut < end and text[cut].isspace():
                cut += 1
            start = cut
        if start < end:
            out.append((start, end))
    return out


def spans_to_mask(offsets: np.ndarray, spans: list) -> np.ndarray:
    """uint8 mask: 1 for tokens whose first character lies inside one of the sorted ``spans``."""
    starts = offsets[:, 0] if len(offsets) else np.zeros(0, np.int64)
    if not spans:
        return np.zeros(len(starts), np.uint8)
    span_starts = np.array([s for s, _ in spans], np.int64)
    span_ends = np.array([e for _, e in spans], np.int64)
    k = np.searchsorted(span_starts, starts, side="right") - 1
    inside = (k >= 0) & (starts < span_ends[np.maximum(k, 0)])
    return inside.astype(np.uint8)


def _encode(tokenizer, text: str) -> tuple[np.ndarray, np.ndarray]:
    # The Rust tokenizer directly: no Python per-token work. Special tokens come from the template.
    enc = tokenizer.backend_tokenizer.encode(text, add_special_tokens=False)
    return np.asarray(enc.ids, dtype=np.int64), np.asarray(enc.offsets, dtype=np.int64).reshape(-1, 2)


def tokenize_conversation(tokenizer, messages: list[dict] | None = None, *, text: str | None = None,
                          max_length: int | None = None, supervise_thinking: bool = True,
                          enable_thinking: bool | None = None, info: TemplateInfo | None = None,
                          verify_markers: bool = True, where: str = "sample") -> tuple[np.ndarray, np.ndarray]:
    """Render one conversation with the chat template -> (input_ids int64[S], loss_mask uint8[S]).

    Give ``messages`` (normalised) or already-templated ``text``. loss_mask is 1 on each
    assistant reply and its end-of-turn token, 0 on system/user turns and template text;
    with ``supervise_thinking=False`` the reply's ``<think>...</think>`` block is 0 too.
    ``enable_thinking`` selects the template's thinking mode (must match serving; None: the
    template's default). Sequences are truncated to ``max_length`` tokens. If the template has
    ``{% generation %}`` markers and ``verify_markers``, the tokenizer's own assistant mask must
    equal ours (``SampleError('mask_mismatch')`` otherwise). ``info`` caches the template probe.
    """
    info = info or probe_template(tokenizer, enable_thinking)
    if (messages is None) == (text is None):
        raise ValueError("give exactly one of messages or text")
    if messages is not None:
        full, spans = assistant_spans(tokenizer, messages, info, where)
    else:
        full, spans = text, text_spans(text, info, where)
    if dict(info.template_kwargs).get("enable_thinking") is False:
        # Served without thinking, the target never writes reasoning: such data would teach the drafter
        # text it will never see.
        if any(_reasoning(full[start:end]) for start, end in spans):
            raise SampleError("thinking_mismatch", f"{where}: a reply has reasoning but the target is served in "
                                                       "non-thinking mode; regenerate without thinking or enable it")
    ids, offsets = _encode(tokenizer, full)
    if messages is not None and info.has_generation_markers and verify_markers:
        marked = tokenizer.apply_chat_template(messages, tokenize=True, return_dict=True,
                                               return_assistant_tokens_mask=True, **dict(info.template_kwargs))
        ours = spans_to_mask(offsets, spans)
        if list(marked["input_ids"]) != ids.tolist() or not np.array_equal(np.asarray(marked["assistant_masks"]), ours):
            raise SampleError("mask_mismatch", f"{where}: the template's {{% generation %}} mask and the "
                                               "rendered-prefix mask disagree; check the template's generation markers")
    if not supervise_thinking:
        spans = drop_thinking(full, spans)
    mask = spans_to_mask(offsets, spans)
    if max_length is not None:
        ids, mask = ids[:max_length], mask[:max_length]
    return ids, mask
