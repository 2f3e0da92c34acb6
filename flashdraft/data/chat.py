"""Conversations: every input shape normalised to the messages a chat template renders.

Input records come in three shapes (all normalised by ``normalize_record``):

- OpenAI: ``{"messages": [...], "tools": [...]}``. Roles ``system``, ``user``, ``assistant``
  and ``tool``; content a string or a list of text parts; an assistant turn may carry
  ``reasoning_content`` (also read from ``reasoning`` / ``thinking``) and ``tool_calls``
  (``[{"type": "function", "function": {"name", "arguments"}}]``, arguments a JSON string or
  an object; the legacy ``function_call`` field too); ``tool`` turns are the tools' results.
- ShareGPT: ``{"conversations": [{"from", "value"}], "tools": ...}`` with ``human`` / ``gpt``
  (and the aliases in ``ROLE_ALIASES``), plus the function-calling variant: a
  ``function_call`` turn (its value the JSON call ``{"name", "arguments"}``) and an
  ``observation`` turn (the result); ``tools`` may be a JSON string.
- plain text already templated: ``{"text": "<|im_start|>user..."}``.

The normal form is what chat templates read: ``{"role", "content": str}`` for every turn;
assistant turns add ``reasoning_content`` and ``thinking`` (the same text: Qwen, GLM and
DeepSeek templates read the first, gpt-oss the second) when there is reasoning, and
``tool_calls`` (``{"type": "function", "function": {"name", "arguments": dict}}``, plus ``id``
when given) when there are calls; ``tool`` turns keep ``tool_call_id`` / ``name`` when given.
Tools become the OpenAI list ``[{"type": "function", "function": {...}}]``. Nothing else is
kept, and nothing is rewritten: reasoning written inline in the content (``<think>...</think>``)
stays there, for the template to handle as it does when serving.

Every problem with one sample raises ``SampleError`` with a short ``reason`` code (counted in
prepare's summary) and a message naming the fix.
"""

from __future__ import annotations

import json
from typing import Any

ROLE_ALIASES = {
    "system": "system", "developer": "system",  # OpenAI's current name for the system turn: rendered as system
    "user": "user", "human": "user",
    "assistant": "assistant", "gpt": "assistant", "model": "assistant", "chatgpt": "assistant", "bot": "assistant",
    "tool": "tool", "observation": "tool", "function": "tool", "ipython": "tool",
    "function_call": "function_call",  # ShareGPT: an assistant tool call, its value the JSON call
}
THINK_OPEN, THINK_CLOSE = "<think>", "</think>"
REASONING_KEYS = ("reasoning_content", "reasoning", "thinking")


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


def _json_value(value: Any, what: str, where: str) -> Any:
    """``value``, or the JSON it holds when it is a string."""
    if not isinstance(value, str):
        return value
    try:
        return json.loads(value)
    except json.JSONDecodeError as exc:
        raise SampleError("bad_tool_call", f"{where}: {what} is not valid JSON ({exc.msg} at column {exc.colno})") \
            from None


def _tool_call(call: Any, where: str) -> dict:
    """One OpenAI (``{"function": {...}}``) or flat (``{"name", "arguments"}``) call -> normal form."""
    if not isinstance(call, dict):
        raise SampleError("bad_tool_call", f"{where}: a tool call must be an object, got {type(call).__name__}")
    function = call.get("function", call)
    if not isinstance(function, dict) or not isinstance(function.get("name"), str) or not function["name"]:
        raise SampleError("bad_tool_call", f"{where}: a tool call needs a function name: {call!r:.120}")
    arguments = function.get("arguments")
    if arguments is None or (isinstance(arguments, str) and not arguments.strip()):
        arguments = {}  # a call without arguments ("" in some datasets)
    arguments = _json_value(arguments, f"the arguments of tool call {function['name']!r}", where)
    if arguments is None:
        arguments = {}
    if not isinstance(arguments, dict):
        raise SampleError("bad_tool_call", f"{where}: the arguments of tool call {function['name']!r} must be a JSON "
                                           f"object, got {type(arguments).__name__}")
    out = {"type": "function", "function": {"name": function["name"], "arguments": arguments}}
    if isinstance(call.get("id"), str):
        out["id"] = call["id"]
    return out


def _reasoning(turn: dict) -> str:
    for key in REASONING_KEYS:
        if isinstance(turn.get(key), str) and turn[key].strip():
            return turn[key]
    return ""


def _assistant(turn: dict, content: str, where: str) -> dict:
    message = {"role": "assistant", "content": content}
    if reasoning := _reasoning(turn):
        message["reasoning_content"] = message["thinking"] = reasoning
    calls = turn.get("tool_calls")
    if calls is None and isinstance(turn.get("function_call"), dict):  # OpenAI's legacy single call
        calls = [turn["function_call"]]
    if calls:
        if not isinstance(calls, list):
            raise SampleError("bad_tool_call", f"{where}: tool_calls must be a list")
        message["tool_calls"] = [_tool_call(c, where) for c in calls]
    return message


def _tool_result(turn: dict, where: str) -> dict:
    raw = turn["content"] if "content" in turn else turn.get("value")
    content = json.dumps(raw, ensure_ascii=False) if isinstance(raw, dict) else _content_text(raw, where)
    message = {"role": "tool", "content": content}
    for key in ("tool_call_id", "name"):
        if isinstance(turn.get(key), str):
            message[key] = turn[key]
    return message


def has_reasoning(message: dict) -> bool:
    """Whether an assistant turn holds reasoning: a reasoning field, or a non-empty inline
    ``<think>...</think>`` block in its content."""
    if message.get("reasoning_content"):
        return True
    content = message.get("content") or ""
    return THINK_CLOSE in content and bool(content.split(THINK_CLOSE)[0].split(THINK_OPEN)[-1].strip())


def normalize_messages(turns: Any, where: str = "sample", *, require_final_assistant: bool = True) -> list[dict]:
    """OpenAI or ShareGPT turns -> the normal form (module docstring).

    Raises ``SampleError``: unknown_role, empty_assistant, bad_tool_call, orphan_tool_result,
    no_assistant, ends_with_user (when ``require_final_assistant``: trailing prompts carry no
    supervision), bad_shape.
    """
    if not isinstance(turns, list) or not turns:
        raise SampleError("bad_shape", f"{where}: messages must be a non-empty list")
    out: list[dict] = []
    for k, turn in enumerate(turns):
        at = f"{where}: turn {k}"
        if not isinstance(turn, dict):
            raise SampleError("bad_shape", f"{at} is a {type(turn).__name__}, expected an object")
        raw_role = turn.get("role", turn.get("from"))
        role = ROLE_ALIASES.get(str(raw_role).lower()) if raw_role is not None else None
        if role is None:
            raise SampleError("unknown_role", f"{at} has unknown role {raw_role!r}; use one of {sorted(ROLE_ALIASES)}")
        if role == "function_call":  # ShareGPT: the call joins the assistant turn it belongs to
            call = _tool_call(_json_value(turn.get("value", turn.get("content")), "the function_call value", at), at)
            if out and out[-1]["role"] == "assistant":  # after its text, or parallel calls: one generation
                out[-1].setdefault("tool_calls", []).append(call)
            else:
                out.append({"role": "assistant", "content": "", "tool_calls": [call]})
            continue
        if role == "tool":
            if not out or out[-1]["role"] not in ("tool", "assistant") or \
                    (out[-1]["role"] == "assistant" and not out[-1].get("tool_calls")):
                raise SampleError("orphan_tool_result", f"{at} is a tool result with no tool call before it; put "
                                                        "the assistant turn that called the tool before it")
            out.append(_tool_result(turn, at))
            continue
        content = _content_text(turn["content"] if "content" in turn else turn.get("value"), at)
        if role != "assistant":
            out.append({"role": role, "content": content})
            continue
        message = _assistant(turn, content, at)
        if not content.strip() and "reasoning_content" not in message and "tool_calls" not in message:
            raise SampleError("empty_assistant", f"{at}: the assistant turn is empty; drop the turn or regenerate it "
                                                 "with `flashdraft regenerate`")
        out.append(message)
    if require_final_assistant:
        if not any(m["role"] == "assistant" for m in out):
            raise SampleError("no_assistant", f"{where}: no assistant turn, nothing to supervise; "
                                              "generate replies with `flashdraft regenerate`")
        if out[-1]["role"] != "assistant":
            raise SampleError("ends_with_user", f"{where}: the conversation ends with a {out[-1]['role']} turn; "
                                                "remove it or generate the reply with `flashdraft regenerate`")
    return out


def normalize_tools(tools: Any, where: str = "sample") -> list[dict]:
    """A record's tool definitions (OpenAI list, flat function specs, or either as a JSON string)
    -> ``[{"type": "function", "function": spec}]``."""
    tools = _json_value(tools, "tools", where)
    if tools is None or tools == []:
        return []
    if not isinstance(tools, list):
        raise SampleError("bad_tool_call", f"{where}: tools must be a list of function definitions")
    out = []
    for tool in tools:
        spec = tool.get("function", tool) if isinstance(tool, dict) else None
        if not isinstance(spec, dict) or not isinstance(spec.get("name"), str):
            raise SampleError("bad_tool_call", f"{where}: a tool definition needs a function name: {tool!r:.120}")
        out.append({"type": "function", "function": spec})
    return out


def normalize_record(record: Any, where: str = "sample", *, require_final_assistant: bool = True) -> dict:
    """One input record -> ``{"messages": [...], "tools": [...]}`` (tools only when there are
    some) or ``{"text": str}``. Raises ``SampleError``."""
    if not isinstance(record, dict):
        raise SampleError("bad_shape", f"{where}: expected a JSON object, got {type(record).__name__}")
    given = [key for key in ("messages", "conversations", "conversation") if record.get(key) is not None]
    if len(given) > 1:  # which one is the conversation? Training on either silently drops the other
        raise SampleError("bad_shape", f"{where}: both {' and '.join(repr(k) for k in given)}; keep one "
                                       "conversation per record")
    for key in given:
        if record.get(key) is not None:
            out = {"messages": normalize_messages(record[key], where, require_final_assistant=require_final_assistant)}
            if tools := normalize_tools(record.get("tools"), where):
                out["tools"] = tools
            return out
    if isinstance(record.get("text"), str):
        if not record["text"].strip():
            raise SampleError("bad_shape", f"{where}: empty text")
        return {"text": record["text"]}
    raise SampleError("bad_shape", f"{where}: no 'messages' (OpenAI), 'conversations' (ShareGPT) or 'text' field; "
                                   f"found keys {sorted(record)[:8]}")
