"""Loss masks from the chat template's own rendering: 1 on exactly what the target generates.

A sample's tokens are the tokenizer's chat template applied to the whole conversation, as the
serving engine applies it. Which of those tokens the target generated is read off the same
rendering, for any template, without ``{% generation %}`` markers:

1. **Where each message's text lands.** The conversation is rendered a second time with every
   text field wrapped in invisible markers: private-use code points (U+F0000 on, skipping any the
   data uses), one per field end, inside the field's surrounding whitespace so that trimming,
   ``split('</think>')`` and ``tojson`` treat the text as before. Deleting the markers must give
   back the first rendering exactly -- the proof that marking changed nothing the template
   decides -- and their positions are where each reply's reasoning, content and tool calls
   (names, string arguments) are, and where each prompt message's content starts.
2. **Where a reply starts.** What precedes it at serving time is the generation prompt: for
   turn *i*, ``render(messages[:i], add_generation_prompt=True)`` minus ``render(messages[:i])``
   (Qwen3.5 ends it with ``<think>\\n``, its non-thinking mode with an empty think block,
   gpt-oss with no channel yet). The reply starts after the last, longest token-prefix of that
   prompt found before the reply's first text: the whole prompt where the template renders the
   turn as it was generated, only its header where history is rendered without what the
   generation prompt adds (Qwen3.5 strips earlier turns' think blocks). Markup between the
   prompt and the first text (gpt-oss's ``<|channel|>analysis<|message|>``, Qwen3's
   ``<think>\\n`` in thinking mode) is generated, so it is supervised.
3. **Where a reply ends.** With its end-of-turn token: the first stop token after the reply's
   last text (so an empty tool result or user turn after it, which has no text to mark, stays
   out of it); the last reply of a template without one (GLM) runs to the rendering's end.
   Inline ``</think>`` splits a reply's content only where the template splits it (probed once).
   Stop tokens are probed from the template (the first
   special token after a probe reply, final or not, the last one after a probe tool call:
   ``<|im_end|>``, ``<|eot_id|>``, gpt-oss's ``<|end|>`` / ``<|return|>`` / ``<|call|>``) plus
   the tokenizer's EOS and ``generation_config.json``'s (GLM stops on the next role's token).
4. **Its reasoning.** The reasoning field's text, when the template renders it, up to and
   including its closing markup (``</think>`` and the whitespace after it, or a channel's end
   token), or an empty think block the target writes in thinking mode: mask 0 with
   ``supervise_thinking=False``.

Character spans become token masks through the fast tokenizer's offsets. When the template does
carry ``{% generation %}`` markers, the tokenizer's own assistant mask is computed as well and
the two must agree. Templated ``{"text": ...}`` records have no messages to mark: their replies
are found by the probed assistant header and stop tokens.
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass, field

import numpy as np

from flashdraft.data.chat import REASONING_KEYS, THINK_CLOSE, THINK_OPEN, SampleError, has_reasoning

_PRIVATE = re.compile("[\U000f0000-\U0010fffd]")  # Supplementary Private Use Areas A and B
_GENERATION_MARKER = re.compile(r"{%-?\s*generation\s*-?%}")
_PROBE_Q, _PROBE_Q2, _PROBE_A = "Probe question", "Probe follow-up", "Probe answer"
_PROBE_TOOL = {"type": "function", "function": {"name": "probe_tool", "description": "A probe.",
                                                "parameters": {"type": "object",
                                                               "properties": {"probe_arg": {"type": "string"}}}}}


@dataclass(frozen=True)
class TemplateInfo:
    """What probing the chat template found (once per tokenizer and thinking mode)."""

    header: str  # the generation prompt after one user turn ('' if the template has none)
    stop_tokens: tuple  # tokens that end an assistant turn (end-of-turn, EOS, ...)
    has_generation_markers: bool  # the template wraps assistant output in {% generation %}
    template_kwargs: tuple  # extra template variables, e.g. (("enable_thinking", False),)
    thinking_switch: bool  # enable_thinking changes the generation prompt
    tool_arguments: str  # "dict", or "json" (a JSON string: DeepSeek-V3 concatenates them)
    text_header: str  # the part of ``header`` history turns have too (templated text records)
    splits_inline_thinking: bool  # the template reads "reasoning</think>answer" content as reasoning + answer
    prompts: dict = field(default_factory=dict, compare=False)  # generation prompt's token-prefixes per context


@dataclass(frozen=True)
class Reply:
    """One assistant reply in the rendered text: ``[start, end)`` is generated by the target;
    ``[thinking_start, thinking_end)`` is its reasoning and the markup around it (empty if none;
    it starts after ``start`` only where a channel header precedes an inline ``<think>``)."""

    start: int
    end: int
    thinking_end: int
    thinking_start: int = -1  # -1: ``start``
    renders_reasoning: bool = False  # the message's reasoning is in the rendered reply (not dropped by the template)

    @property
    def thinking(self) -> tuple[int, int]:
        return (self.start if self.thinking_start < 0 else self.thinking_start), self.thinking_end


# ---- rendering ---------------------------------------------------------------------------
def render(tokenizer, messages: list[dict], *, tools: list | None = None, add_generation_prompt: bool = False,
           template_kwargs=()) -> str:
    """The chat template applied to ``messages`` as text (no tokenization)."""
    return tokenizer.apply_chat_template(messages, tools=tools or None, tokenize=False,
                                         add_generation_prompt=add_generation_prompt, **dict(template_kwargs))


def _render_sample(tokenizer, messages, tools, kwargs, where: str) -> str:
    try:
        return render(tokenizer, messages, tools=tools, template_kwargs=kwargs)
    except Exception as exc:  # jinja's TemplateError (raise_exception), or the template's own TypeError
        raise SampleError("template_error", f"{where}: the chat template refuses this conversation "
                                            f"({type(exc).__name__}: {exc})") from None


def _for_template(messages: list[dict], tool_arguments: str) -> list[dict]:
    """Messages with tool-call arguments in the form the template renders."""
    if tool_arguments == "dict":
        return messages
    out = []
    for m in messages:
        if m.get("tool_calls"):
            m = {**m, "tool_calls": [{**c, "function": {**c["function"], "arguments": json.dumps(
                c["function"]["arguments"], ensure_ascii=False)}} for c in m["tool_calls"]]}
        out.append(m)
    return out


def generation_prompt(tokenizer, context: list[dict], tools, kwargs) -> str | None:
    """What the template adds after ``context`` to prompt the next assistant turn (None if it
    cannot say: the template refuses the context or does not append its prompt)."""
    try:
        base = render(tokenizer, context, tools=tools, template_kwargs=kwargs)
        prompted = render(tokenizer, context, tools=tools, add_generation_prompt=True, template_kwargs=kwargs)
    except Exception:
        return None
    return prompted[len(base):] if prompted.startswith(base) else None


# ---- probing -----------------------------------------------------------------------------
def _special_tokens(tokenizer) -> set[str]:
    special = set(tokenizer.all_special_tokens)
    special.update(t.content for t in tokenizer.added_tokens_decoder.values() if t.special)
    return special


def _tokens(tokenizer, text: str) -> list[str]:
    return tokenizer.backend_tokenizer.encode(text, add_special_tokens=False).tokens


def _generation_config_eos(tokenizer) -> list[str]:
    """EOS tokens of ``generation_config.json`` beside the tokenizer (what the model stops on)."""
    path = os.path.join(str(getattr(tokenizer, "name_or_path", "") or ""), "generation_config.json")
    try:
        with open(path, encoding="utf-8") as f:
            ids = json.load(f).get("eos_token_id")
    except (OSError, ValueError, AttributeError):
        return []
    ids = ids if isinstance(ids, list) else [ids] if isinstance(ids, int) else []
    return [t for t in tokenizer.convert_ids_to_tokens([i for i in ids if isinstance(i, int)]) if t]


def _probe_stops(tokenizer, kwargs, tool_arguments: str) -> list[str]:
    special, stops = _special_tokens(tokenizer), []
    user, reply = {"role": "user", "content": _PROBE_Q}, {"role": "assistant", "content": _PROBE_A}
    for chat in ([user, reply], [user, reply, {"role": "user", "content": _PROBE_Q2}]):
        try:
            text = render(tokenizer, chat, template_kwargs=kwargs)
        except Exception:
            continue
        if (i := text.find(_PROBE_A)) >= 0:
            stops += [t for t in _tokens(tokenizer, text[i + len(_PROBE_A):]) if t in special][:1]
    # After a tool call: the last special token of the rendering -- unless it also closes each
    # of two parallel calls (GLM's </tool_call>), which ends a call, not the turn.
    def calls(*values):
        return {"role": "assistant", "content": "", "tool_calls": [{"type": "function", "function": {
            "name": "probe_tool", "arguments": {"probe_arg": v}}} for v in values]}
    try:
        two = render(tokenizer, _for_template([user, calls("ProbeValue", "ProbeOther")], tool_arguments),
                     tools=[_PROBE_TOOL], template_kwargs=kwargs)
        between = two[two.find("ProbeValue"): two.find("ProbeOther")] if "ProbeOther" in two else ""
    except Exception:
        between = ""
    try:
        text = render(tokenizer, _for_template([user, calls("ProbeValue")], tool_arguments), tools=[_PROBE_TOOL],
                      template_kwargs=kwargs)
        last = [t for t in _tokens(tokenizer, text[text.rfind("ProbeValue") + len("ProbeValue"):]) if t in special]
        if "ProbeValue" in text and last and last[-1] not in _tokens(tokenizer, between):
            stops.append(last[-1])
    except Exception:
        pass
    stops += _generation_config_eos(tokenizer) + ([tokenizer.eos_token] if tokenizer.eos_token else [])
    return list(dict.fromkeys(stops))


def _probe_tool_arguments(tokenizer, kwargs) -> str:
    """"dict" when the template renders arguments given as an object (the documented form),
    else "json" when it needs the JSON string (DeepSeek-V3's template concatenates them)."""
    chat = [{"role": "user", "content": _PROBE_Q}, {"role": "assistant", "content": "", "tool_calls": [
        {"type": "function", "function": {"name": "probe_tool", "arguments": {"probe_arg": "ProbeValue"}}}]}]
    try:
        render(tokenizer, chat, tools=[_PROBE_TOOL], template_kwargs=kwargs)
        return "dict"
    except Exception:
        pass
    try:
        render(tokenizer, _for_template(chat, "json"), tools=[_PROBE_TOOL], template_kwargs=kwargs)
        return "json"
    except Exception:
        return "dict"  # tools unsupported: a conversation with calls fails as template_error


def _common_token_prefix(tokenizer, a: str, b: str) -> str:
    """The longest prefix of ``a`` that ends on one of its token boundaries and starts ``b``."""
    return max((prefix for prefix in _token_prefixes(tokenizer, a) if b.startswith(prefix)), key=len, default="")


def probe_template(tokenizer, enable_thinking: bool | None = None) -> TemplateInfo:
    """Probe ``tokenizer``'s chat template: its generation prompt, stop tokens, thinking switch
    and tool-argument form.

    ``enable_thinking`` None leaves the template's default; True/False is passed to the template
    as ``enable_thinking`` (Qwen3 convention), as serving engines do; a template whose
    generation prompt ignores it is refused for True/False (the serving mode could not be set).
    """
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError("the tokenizer has no chat_template; use a chat (instruct) tokenizer, or give "
                         "already-templated {'text': ...} records")
    kwargs = () if enable_thinking is None else (("enable_thinking", bool(enable_thinking)),)
    user = [{"role": "user", "content": _PROBE_Q}]
    header = generation_prompt(tokenizer, user, None, kwargs) or ""
    switch = {generation_prompt(tokenizer, user, None, (("enable_thinking", v),)) for v in (True, False)}
    if enable_thinking is not None and len(switch) < 2:
        raise ValueError(f"the chat template ignores enable_thinking (its generation prompt is {header!r} either way): "
                         "there is no thinking mode to choose; use --thinking default")
    tool_arguments = _probe_tool_arguments(tokenizer, kwargs)
    stops = _probe_stops(tokenizer, kwargs, tool_arguments)
    if not stops:
        raise ValueError("cannot find the token that ends an assistant turn in the chat template (no special token "
                         "follows a reply and the tokenizer has no eos_token); set the tokenizer's eos_token")
    history = ""
    try:
        base = render(tokenizer, user, template_kwargs=kwargs)
        chat = render(tokenizer, user + [{"role": "assistant", "content": _PROBE_A},
                                         {"role": "user", "content": _PROBE_Q2}], template_kwargs=kwargs)
        if chat.startswith(base) and _PROBE_A in chat:
            history = chat[len(base): chat.index(_PROBE_A)]
    except Exception:
        pass
    text_header = _common_token_prefix(tokenizer, header, history) if history else header
    template = tokenizer.chat_template if isinstance(tokenizer.chat_template, str) else ""
    return TemplateInfo(header, tuple(stops), bool(_GENERATION_MARKER.search(template)), kwargs, len(switch) > 1,
                        tool_arguments, text_header, _probe_inline_thinking(tokenizer, kwargs))


def _probe_inline_thinking(tokenizer, kwargs) -> bool:
    """Whether the template splits a reply's content at ``</think>`` (Qwen, DeepSeek, GLM) or
    renders it as written (Llama, gpt-oss, Qwen3-2507): then ``</think>`` is just text."""
    inline = f"{_PROBE_Q}{THINK_CLOSE}{_PROBE_A}"
    try:
        text = render(tokenizer, [{"role": "user", "content": _PROBE_Q2}, {"role": "assistant", "content": inline}],
                      template_kwargs=kwargs)
    except Exception:
        return False
    return inline not in text


# ---- marking -----------------------------------------------------------------------------
class _Marks:
    """Hands out marker code points, skipping those the data uses, and remembers, for each, its
    message, field kind and end."""

    def __init__(self, used: set[str]):
        self.used, self.next = used, 0xF0000
        self.index: dict[str, int] = {}  # marker -> its index in owner
        self.owner: list[tuple[int, str, str]] = []  # (message index, kind, "open"|"close")

    def _new(self, i: int, kind: str, end: str) -> str:
        while chr(self.next) in self.used or self.next in (0xFFFFE, 0xFFFFF):  # (non-characters between planes)
            self.next += 1
        if self.next > 0x10FFFD:
            raise SampleError("reserved_characters", "the conversation uses too many private-use code points for "
                                                     "flashdraft to mark its replies")
        mark = chr(self.next)
        self.next += 1
        self.index[mark] = len(self.owner)
        self.owner.append((i, kind, end))
        return mark

    def wrap(self, text: str, i: int, kind: str) -> str:
        """``text`` with markers around its stripped core (outside whitespace untouched)."""
        core = text.strip()
        if not core:
            return text
        lead = text[: len(text) - len(text.lstrip())]
        return lead + self._new(i, kind, "open") + core + self._new(i, kind, "close") + text[len(lead) + len(core):]

    def point(self, text: str, i: int) -> str:
        """``text`` with one marker where its stripped core starts."""
        core = text.strip()
        if not core:
            return text
        lead = len(text) - len(text.lstrip())
        return text[:lead] + self._new(i, "prompt", "open") + text[lead:]


def _mark_content(marks: _Marks, content: str, i: int, splits_thinking: bool) -> str:
    # Inline reasoning: before </think> where the template splits content there, or a leading
    # <think>...</think> block anywhere (a template that renders content as written keeps it as
    # text, but it is still the reply's reasoning). Otherwise a "</think>" is just text.
    if THINK_CLOSE in content and (splits_thinking or content.lstrip().startswith(THINK_OPEN)):
        parts = content.split(THINK_CLOSE)  # reasoning before the first </think>, the answer after the last
        head, middle, tail = parts[0], parts[1:-1], parts[-1]
        cut = head.rfind(THINK_OPEN) + len(THINK_OPEN) if THINK_OPEN in head else 0
        return THINK_CLOSE.join([head[:cut] + marks.wrap(head[cut:], i, "reasoning"), *middle,
                                 marks.wrap(tail, i, "content")])
    return marks.wrap(content, i, "content")


def _mark_message(marks: _Marks, m: dict, i: int, prompts: bool, splits_thinking: bool) -> dict:
    if m["role"] != "assistant":
        return {**m, "content": marks.point(m["content"], i)} if prompts else m
    out = {**m, "content": _mark_content(marks, m["content"], i, splits_thinking)}
    if "reasoning_content" in m:
        out["reasoning_content"] = out["thinking"] = marks.wrap(m["reasoning_content"], i, "reasoning")
    if m.get("tool_calls"):
        calls = []
        for c in m["tool_calls"]:
            f = c["function"]
            args = {k: marks.wrap(v, i, "call") if isinstance(v, str) else v for k, v in f["arguments"].items()}
            calls.append({**c, "function": {**f, "name": marks.wrap(f["name"], i, "call"), "arguments": args}})
        out["tool_calls"] = calls
    return out


def _unmark(marked: str, marks: _Marks) -> tuple[str, dict[int, int]]:
    """(``marked`` without the markers, marker index -> its first position in that text)."""
    pieces, first, pos, length = [], {}, 0, 0
    for m in _PRIVATE.finditer(marked):
        if (index := marks.index.get(m.group())) is None:
            continue  # the data's own character
        pieces.append(marked[pos: m.start()])
        length += m.start() - pos
        first.setdefault(index, length)
        pos = m.end()
    pieces.append(marked[pos:])
    return "".join(pieces), first


def _field_positions(tokenizer, messages, tools, info: TemplateInfo, full: str, where: str):
    """For each message, {(kind, "open"|"close"): [positions in ``full``]} of its rendered fields."""
    used = set(_PRIVATE.findall(full))  # private-use characters of the data itself: never markers
    # Marking a prompt's start can trip a template's own test of it (Qwen3: a user turn that
    # starts with <tool_response>); without those marks a reply's start is searched from the
    # previous reply's end instead, and its end is the same (the first stop after its text).
    for prompts in (True, False):
        marks = _Marks(used)
        marked = [_mark_message(marks, m, i, prompts, info.splits_inline_thinking) for i, m in enumerate(messages)]
        try:
            text, first = _unmark(render(tokenizer, _for_template(marked, info.tool_arguments), tools=tools,
                                         template_kwargs=info.template_kwargs), marks)
        except Exception:
            continue
        if text == full:
            fields: list[dict] = [{} for _ in messages]
            for index, pos in first.items():
                i, kind, end = marks.owner[index]
                fields[i].setdefault((kind, end), []).append(pos)
            return fields
    raise SampleError("template_mismatch", f"{where}: the chat template renders this conversation differently once "
                                           "its replies are marked, so what the target generates cannot be located")


# ---- replies -----------------------------------------------------------------------------
def _token_prefixes(tokenizer, prompt: str) -> tuple[str, ...]:
    """The prefixes of ``prompt`` that end on its token boundaries."""
    ends = [end for _, end in tokenizer.backend_tokenizer.encode(prompt, add_special_tokens=False).offsets]
    return tuple(prompt[:end] for end in ends) if prompt else ()


def _after_prompt(full: str, lo: int, hi: int, prefixes: tuple[str, ...]) -> int:
    """Where generation starts before ``hi``: right after the rightmost (then longest) of the
    generation prompt's token-prefixes found in ``full[lo:hi]``; ``hi`` if none is."""
    best = (-1, 0)
    for prefix in prefixes:
        end = len(prefix)
        j = full.rfind(prefix, lo, hi)
        if j >= 0:
            best = max(best, (j + end, end))
    return best[0] if best[0] >= 0 else hi


def _reply_start(tokenizer, full: str, lo: int, first: int, context: list[dict], tools, info: TemplateInfo) -> int:
    """Where the reply whose first text is at ``first`` starts (module docstring, step 2). The
    generation prompt is rendered once per kind of context -- the role of the message before
    the reply, with or without tools -- which is all real templates make it depend on
    (DeepSeek-V3 adds nothing after tool results), and reused for later samples."""
    key = (context[-1]["role"] if context else None, bool(tools))
    if key not in info.prompts:
        prompt = generation_prompt(tokenizer, context, tools, info.template_kwargs)
        info.prompts[key] = _token_prefixes(tokenizer, info.header if prompt is None else prompt)
    return _after_prompt(full, lo, first, info.prompts[key])


def _first_stop(full: str, lo: int, hi: int, stops) -> int:
    hits = [j + len(s) for s in stops if (j := full.find(s, lo, hi)) >= 0]
    return min(hits) if hits else lo


def _thinking_end(full: str, start: int, end: int, fields: dict, stops) -> int:
    """End of the reasoning and its closing markup in the reply ``[start, end)`` (start: none)."""
    opens = [p for (kind, e), ps in fields.items() if e == "open" and kind != "reasoning" for p in ps]
    closes = fields.get(("reasoning", "close"))
    lo = min(closes) if closes else start
    rest = min([p for p in opens if p >= lo] or [end])  # where the content or a tool call starts
    j = full.find(THINK_CLOSE, lo, rest)
    if j >= 0:  # "</think>" (an empty think block too) and the whitespace after it
        j += len(THINK_CLOSE)
        while j < rest and full[j].isspace():
            j += 1
        return j
    if closes:  # a channel that closes with a stop token (gpt-oss: <|end|>), else the text itself
        return min(_first_stop(full, lo, rest, stops), rest)
    return start


def assistant_replies(tokenizer, messages: list[dict], info: TemplateInfo, *, tools: list | None = None,
                      where: str = "sample") -> tuple[str, list[Reply]]:
    """Render ``messages`` and locate each assistant reply in the text (module docstring)."""
    kwargs = info.template_kwargs
    templated = _for_template(messages, info.tool_arguments)  # its prefixes are each reply's context
    full = _render_sample(tokenizer, templated, tools, kwargs, where)
    fields = _field_positions(tokenizer, messages, tools, info, full, where)
    firsts = [min((p for (_, e), ps in f.items() if e == "open" for p in ps), default=None) for f in fields]
    replies, lo = [], 0
    for i, m in enumerate(messages):
        if firsts[i] is not None and m["role"] != "assistant":
            lo = max(lo, firsts[i])
        if m["role"] != "assistant" or firsts[i] is None:
            continue  # a reply the template does not render (nothing of it to supervise)
        first = firsts[i]
        start = _reply_start(tokenizer, full, lo, first, templated[:i], tools, info)
        last = max(p for (_, e), ps in fields[i].items() if e == "close" for p in ps)
        # The reply ends with the first stop token after its last text, before any later
        # message's text (a template may render a message elsewhere: DeepSeek puts every system
        # prompt first). The last reply may have none (GLM's): it runs to the rendering's end.
        hi = min([p for p in firsts[i + 1:] if p is not None and p > last] or [len(full)])
        end = _first_stop(full, last, hi, info.stop_tokens)
        if end == last and hi == len(full):
            end = max(last, len(full.rstrip()))
        opens = fields[i].get(("reasoning", "open"))
        think = full.rfind(THINK_OPEN, start, min(opens)) if opens else -1
        header = think > start and full[start:think].strip()  # gpt-oss: an inline <think> in the final channel
        replies.append(Reply(start, end, _thinking_end(full, start, end, fields[i], info.stop_tokens),
                             think if header else -1, has_reasoning(m) and bool(opens)))
        lo = end
    return full, replies


def text_replies(text: str, info: TemplateInfo, where: str = "sample") -> list[Reply]:
    """Replies of already-templated text: after each assistant header (and the rest of the
    generation prompt, when the text has it), up to the first stop token."""
    if not info.text_header:
        raise SampleError("template_mismatch", f"{where}: the chat template has no generation prompt, so assistant "
                                               "turns cannot be located in plain text; give messages instead")
    rest, replies, cursor = info.header[len(info.text_header):], [], 0
    while (j := text.find(info.text_header, cursor)) >= 0:
        start = j + len(info.text_header)
        if rest and text.startswith(rest, start):
            start += len(rest)
        end = _first_stop(text, start, len(text), info.stop_tokens)
        if end == start:
            raise SampleError("template_mismatch", f"{where}: no end-of-turn token after an assistant turn")
        replies.append(Reply(start, end, _thinking_end(text, start, end, {}, info.stop_tokens)))
        cursor = end
    if not replies:
        raise SampleError("no_assistant", f"{where}: no assistant turn ({info.text_header!r}) in the text")
    return replies


def _text_has_reasoning(text: str, replies: list[Reply]) -> bool:
    return any(has_reasoning({"content": text[r.start: r.end]}) for r in replies)


# ---- tokens ------------------------------------------------------------------------------
def spans_to_mask(offsets: np.ndarray, spans: list) -> np.ndarray:
    """uint8 mask: 1 for tokens whose first character lies inside one of the sorted ``spans``."""
    starts = offsets[:, 0] if len(offsets) else np.zeros(0, np.int64)
    spans = [(s, e) for s, e in spans if e > s]
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


def _refuse_markers_in_replies(tokenizer, messages: list[dict], info: TemplateInfo, where: str) -> None:
    """The rule for stop and role tokens inside a reply: an assistant turn whose text (content,
    reasoning, tool-call arguments) holds the template's end-of-turn / EOS tokens or the special
    tokens of its role header (``<|im_end|>``, ``<|im_start|>``) is dropped (``marker_in_reply``).
    Rendered, they become real end-of-turn and role tokens supervised as the reply, a fake user
    turn included; a served target stops at its first end-of-turn, so it never generates that.
    (In user, system or tool-result turns they are never supervised and stay.)"""
    special = set(getattr(tokenizer, "all_special_tokens", ()))
    markers = {t for t in info.stop_tokens if t} | {t for t in special if t and t in info.header}
    markers -= {THINK_OPEN, THINK_CLOSE}  # inline reasoning markup is the reply's own
    for k, message in enumerate(messages):
        if message.get("role") != "assistant":
            continue
        texts = [message.get("content"), *(message.get(key) for key in REASONING_KEYS),
                 *(json.dumps(call, ensure_ascii=False) for call in message.get("tool_calls") or ())]
        for text in texts:
            found = next((m for m in sorted(markers) if isinstance(text, str) and m in text), None)
            if found is not None:
                raise SampleError("marker_in_reply", f"{where}: assistant turn {k} holds {found!r}, the chat "
                                                     "template's own end-of-turn or role token, which would be "
                                                     "trained as generated; remove it from the data")


def tokenize_conversation(tokenizer, messages: list[dict] | None = None, *, tools: list | None = None,
                          text: str | None = None, max_length: int | None = None, supervise_thinking: bool = True,
                          enable_thinking: bool | None = None, info: TemplateInfo | None = None,
                          verify_markers: bool = True, where: str = "sample") -> tuple[np.ndarray, np.ndarray]:
    """Render one conversation with the chat template -> (input_ids int64[S], loss_mask uint8[S]).

    Give normalised ``messages`` (and their ``tools``) or already-templated ``text``. loss_mask
    is 1 on what the target generates (module docstring); with ``supervise_thinking=False`` the
    reasoning and its markup are 0 too. ``enable_thinking`` selects the template's thinking mode
    (must match serving; None: the template's default). When the generation prompt closes the
    think block (non-thinking mode), a reply whose reasoning the template renders is refused
    (``thinking_mismatch``); reasoning the template drops (Qwen3 / Qwen3.5 render none for the
    replies before the last user turn) is not in the sample, which is kept. Sequences are
    truncated to ``max_length`` tokens. If the template has ``{% generation %}`` markers and
    ``verify_markers``, the tokenizer's own assistant mask must equal ours (``mask_mismatch``).
    ``info`` caches the template probe.
    """
    info = info or probe_template(tokenizer, enable_thinking)
    if (messages is None) == (text is None):
        raise ValueError("give exactly one of messages or text")
    served_without_thinking = THINK_CLOSE in info.header  # the generation prompt closes the think block
    if messages is not None:
        full, replies = assistant_replies(tokenizer, messages, info, tools=tools, where=where)
        if served_without_thinking and any(r.renders_reasoning for r in replies):
            raise SampleError("thinking_mismatch", f"{where}: a reply has reasoning but the target is served in "
                                                   "non-thinking mode; regenerate without thinking or enable it")
        _refuse_markers_in_replies(tokenizer, messages, info, where)
    else:
        full, replies = text, text_replies(text, info, where)
        if served_without_thinking and _text_has_reasoning(text, replies):
            raise SampleError("thinking_mismatch", f"{where}: a reply has reasoning but the target is served in "
                                                   "non-thinking mode; regenerate without thinking or enable it")
    ids, offsets = _encode(tokenizer, full)
    spans = [(r.start, r.end) for r in replies]
    if messages is not None and info.has_generation_markers and verify_markers:
        marked = tokenizer.apply_chat_template(_for_template(messages, info.tool_arguments), tools=tools or None,
                                               tokenize=True, return_dict=True, return_assistant_tokens_mask=True,
                                               **dict(info.template_kwargs))
        if list(marked["input_ids"]) != ids.tolist() or \
                not np.array_equal(np.asarray(marked["assistant_masks"]), spans_to_mask(offsets, spans)):
            raise SampleError("mask_mismatch", f"{where}: the template's {{% generation %}} mask and the "
                                               "rendered-prefix mask disagree; check the template's generation markers")
    if not supervise_thinking:
        spans = [span for r in replies for span in ((r.start, r.thinking[0]), (max(r.start, r.thinking_end), r.end))]
    mask = spans_to_mask(offsets, spans)
    if max_length is not None:
        ids, mask = ids[:max_length], mask[:max_length]
    return ids, mask
