#!/usr/bin/env python3
"""Rewrite a flashdraft tree from the old config sections to the ones cut by owner (issue 37).

Run from a worktree's root:  python .rename_config_keys.py [--check] [PATH ...]
(default: every git-tracked text file). Idempotent: a second run changes nothing (no new key is
an old one). It rewrites, from the one OLD -> NEW table below (a copy of flashdraft.config.RENAMED,
checked against it when that exists):

- Python attribute accesses on a config: ``cfg.model.block_size`` / ``self.config.train.eval_every``
  (the object before ``.model`` must be named cfg, config or run_config: ``target.model.config`` and
  other ``.model`` objects are left alone);
- keyword overrides of the benchmarks' helpers: ``model__block_size=8``;
- dotted keys in Python strings and comments (not inside an f-string's ``{...}``) and in every
  other text file: "model.block_size=4", ``train.eval_every``, error messages, docs;
- YAML sections in .md / .yaml files: a ``model:`` block (or ``model: {...}``) is split into
  ``target:`` and ``drafter:`` blocks; moved ``train:`` / ``data:`` keys go to checkpoint / eval.

Not rewritten (by hand): a local variable holding a section (``model = cfg.model``; ``model.drafter``),
whole-section uses (``DFlash2Modules.of(cfg.model)``, ``replace(config.model, ...)``), dict forms
(``{"model": {...}}``, ``saved.get("model")``, ``("model", "block_size")``) and bare field names.
It prints the lines that likely still need a hand edit (never changing them). Review with
``git diff``, then ``ruff check`` (a rewritten line may pass 120 characters).
"""

from __future__ import annotations

import io
import re
import subprocess
import sys
import tokenize
from pathlib import Path

OLD_TO_NEW = {
    "model.target": "target.path",
    "model.target_layer_ids": "target.layer_ids",
    "model.num_taps": "target.num_taps",
    "model.dtype": "target.dtype",
    "model.attn_implementation": "target.attn_implementation",
    "model.trust_remote_code": "target.trust_remote_code",
    "model.tensor_parallel": "target.tensor_parallel",
    "model.expert_parallel": "target.expert_parallel",
    "model.target_backend": "target.backend",
    **{f"model.vllm_{k}": f"target.vllm_{k}" for k in (
        "python", "tensor_parallel", "expert_parallel", "quantization", "gpu_memory_utilization", "max_model_len",
        "devices", "check_samples")},
    "model.drafter": "drafter.family",
    "model.num_draft_layers": "drafter.num_layers",
    "model.block_size": "drafter.block_size",
    "model.mask_token_id": "drafter.mask_token_id",
    "model.drafter_attention": "drafter.attention",
    "model.activation_checkpointing": "drafter.activation_checkpointing",
    "model.drafter_layer_types": "drafter.layer_types",
    "model.drafter_sliding_window": "drafter.sliding_window",
    "model.drafter_causal": "drafter.causal",
    "model.drafter_attention_sink": "drafter.attention_sink",
    "model.init_from": "drafter.init_from",
    "model.conv_kernel_size": "drafter.conv_kernel_size",
    "model.conv_group_size": "drafter.conv_group_size",
    "model.selector_rank": "drafter.selector_rank",
    "model.selector_top_k": "drafter.selector_top_k",
    "train.save_every": "checkpoint.save_every",
    "train.keep_last": "checkpoint.keep_last",
    "train.resume": "checkpoint.resume",
    "train.eval_every": "eval.every",
    "train.eval_prompts": "eval.num_prompts",
    "train.eval_max_new_tokens": "eval.max_new_tokens",
    "train.eval_temperature": "eval.temperature",
    "train.eval_top_p": "eval.top_p",
    "train.eval_top_k": "eval.top_k",
    "data.eval_path": "eval.data_path",
    "data.eval_prompts": "eval.prompts_path",
}
# code-only renames (a property, not a config key)
CODE_ONLY = {"model.layer_types": "drafter.per_layer_types"}
HOLDERS = ("cfg", "config", "run_config")  # names a Config is held under: `<holder>.model.<field>`
SKIP = {".rename_config_keys.py", "tests/test_config_owners.py"}  # files that must keep old keys
SKIP_UNDER = ("tests/fixtures/",)

_SECTIONS = "|".join(sorted({k.split(".")[0] for k in OLD_TO_NEW}))
_FIELDS = "|".join(sorted({k.split(".")[1] for k in {**OLD_TO_NEW, **CODE_ONLY}}, key=len, reverse=True))
ATTR = re.compile(rf"\b((?:{'|'.join(HOLDERS)})\s*)\.({_SECTIONS})\.({_FIELDS})\b")
KWARG = re.compile(rf"(?<![\w.])({_SECTIONS})__({_FIELDS})\b")
DOTTED = re.compile(rf"(?<![\w./-])({_SECTIONS})\.({_FIELDS})\b")
YAML_HEAD = re.compile(rf"^(\s*)({_SECTIONS}):\s*(#.*)?$")
YAML_FLOW = re.compile(rf"^(\s*)({_SECTIONS}):\s*\{{(.*)\}}\s*(#.*)?$")


def _new(section: str, key: str, code: bool = False) -> tuple[str, str] | None:
    new = OLD_TO_NEW.get(f"{section}.{key}") or (CODE_ONLY.get(f"{section}.{key}") if code else None)
    return tuple(new.split(".")) if new else None


def _sub(pattern: re.Pattern, text: str, code: bool, sep: str = ".") -> str:
    def one(m):
        *head, section, key = m.groups()
        new = _new(section, key, code)
        if new is None:
            return m.group(0)
        prefix = f"{head[0]}." if head else ""
        return f"{prefix}{new[0]}{sep}{new[1]}"
    return pattern.sub(one, text)


def rewrite_text(text: str) -> str:
    """Dotted keys in prose, strings, shell lines."""
    return _sub(DOTTED, text, code=False)


def _outside_braces(body: str, fn) -> str:
    """``fn`` applied to an f-string body's literal parts only (not to its {expressions})."""
    out, i, depth, start = [], 0, 0, 0
    while i < len(body):
        c = body[i]
        if depth == 0 and body.startswith(("{{", "}}"), i):
            i += 2
            continue
        if c == "{":
            if depth == 0:
                out.append(fn(body[start:i]))
                start = i
            depth += 1
        elif c == "}" and depth:
            depth -= 1
            if depth == 0:  # an expression: only the string literals inside it are text
                out.append(re.sub(r"'[^'{}]*'|\"[^\"{}]*\"", lambda m: fn(m.group(0)), body[start:i + 1]))
                start = i + 1
        i += 1
    out.append(fn(body[start:]) if depth == 0 else body[start:])
    return "".join(out)


def _string_token(tok: str) -> str:
    prefix = re.match(r"[A-Za-z]*", tok).group(0)
    if "f" in prefix.lower():
        return prefix + _outside_braces(tok[len(prefix):], rewrite_text)
    return rewrite_text(tok)


def rewrite_python(text: str) -> str:
    text = _sub(ATTR, text, code=True)
    text = _sub(KWARG, text, code=False, sep="__")
    lines = text.splitlines(keepends=True)
    offsets = [0]
    for line in lines:
        offsets.append(offsets[-1] + len(line))
    edits = []
    for tok in tokenize.generate_tokens(io.StringIO(text).readline):
        if tok.type in (tokenize.STRING, tokenize.COMMENT):
            new = _string_token(tok.string) if tok.type == tokenize.STRING else rewrite_text(tok.string)
            if new != tok.string:
                start = offsets[tok.start[0] - 1] + tok.start[1]
                end = offsets[tok.end[0] - 1] + tok.end[1]
                edits.append((start, end, new))
    for start, end, new in reversed(edits):
        text = text[:start] + new + text[end:]
    return text


def _split_flow(body: str) -> list[str]:
    items, depth, cur = [], 0, ""
    for c in body:
        if c in "[{":
            depth += 1
        elif c in "]}":
            depth -= 1
        if c == "," and depth == 0:
            items.append(cur)
            cur = ""
        else:
            cur += c
    return [i.strip() for i in items + [cur] if i.strip()]


def rewrite_yaml_blocks(text: str) -> str:
    """Split ``model:`` blocks into target / drafter, move train / data keys to checkpoint / eval."""
    lines, out, i = text.splitlines(keepends=True), [], 0
    while i < len(lines):
        line = lines[i]
        flow = YAML_FLOW.match(line.rstrip("\n"))
        if flow:
            indent, section, body, comment = flow.groups()
            groups: dict[str, list[str]] = {}
            for item in _split_flow(body):
                key, _, value = item.partition(":")
                new = _new(section, key.strip()) or (section, key.strip())
                groups.setdefault(new[0], []).append(f"{new[1]}:{value}")
            if list(groups) != [section] or any(_new(section, k.split(":")[0]) for k in groups.get(section, [])):
                tail = f"  {comment}" if comment else ""
                for n, (sec, items) in enumerate(groups.items()):
                    out.append(f"{indent}{sec}: {{{', '.join(items)}}}{tail if n == 0 else ''}\n")
                i += 1
                continue
        head = YAML_HEAD.match(line.rstrip("\n"))
        if not head:
            out.append(line)
            i += 1
            continue
        indent, section, comment = head.groups()
        j, entries, preamble = i + 1, [], []  # entries: [new section, lines]
        while j < len(lines):
            body = lines[j]
            if not body.strip() or len(body) - len(body.lstrip()) <= len(indent) or body.lstrip().startswith("```"):
                break
            key = re.match(r"^(\s+)(\w+):", body)
            if key and len(key.group(1)) > len(indent) and (not entries or len(key.group(1)) <= entries[-1][2]):
                new = _new(section, key.group(2)) or (section, key.group(2))
                body = body.replace(f"{key.group(2)}:", f"{new[1]}:", 1)
                entries.append([new[0], [body], len(key.group(1))])
            elif entries:
                entries[-1][1].append(body)
            else:
                preamble.append(body)
            j += 1
        if all(sec == section for sec, _, _ in entries) and not any(
                _new(section, re.match(r"^\s+(\w+):", e[1][0]).group(1)) for e in entries):
            out.append(line)
            i += 1
            continue
        groups = {}
        for sec, body, _ in entries:
            groups.setdefault(sec, []).extend(body)
        for n, (sec, body) in enumerate(groups.items()):
            tail = f"  {comment}" if comment and n == 0 else ""
            out.append(f"{indent}{sec}:{tail}\n")
            if n == 0:
                out.extend(preamble)
            out.extend(body)
        i = j
    return "".join(out)


def _protect_table(text: str, fn) -> str:
    """``fn`` over ``text`` except flashdraft.config's RENAMED table (its old keys stay old)."""
    m = re.search(r"^RENAMED = \{\n.*?^\}\n", text, flags=re.S | re.M)
    if not m:
        return fn(text)
    return fn(text[:m.start()]) + m.group(0) + fn(text[m.end():])


def rewrite_file(path: str, text: str) -> str:
    if path.endswith(".py"):
        return _protect_table(text, rewrite_python)
    if path.endswith((".md", ".yaml", ".yml")):
        text = rewrite_yaml_blocks(text)
    return rewrite_text(_sub(ATTR, text, code=False))


def _check_table() -> None:
    config = Path("flashdraft/config.py")
    if config.is_file() and "RENAMED = {" in config.read_text():
        sys.path.insert(0, ".")
        from flashdraft.config import RENAMED  # noqa: PLC0415
        if RENAMED != OLD_TO_NEW:
            sys.exit("the table here differs from flashdraft.config.RENAMED: make them one table first")


# what the rewrite leaves to a person: whole-section uses, dict forms, the old classes, locals holding a section
LEFTOVER = re.compile(
    rf"\b(?:cfg|config)\.model\b(?!\.)|[\"']model[\"']\s*:\s*\{{|\.get\([\"']model[\"']|\([\"']model[\"'],"
    rf"|\[[\"']model[\"']\]\[|\bModelConfig\b|^model:\s*$|(?<![\w.])(?:model|train|data)\.({_FIELDS})\b"
    rf"|\)\.model\b|[\"']model:\\n"
    rf"|(?<![\w.])(?:train|data)\.(?:eval_\w+|save_every|keep_last|resume)\b")


def leftovers(path: str, old: str, new: str) -> list[str]:
    """Lines of ``new`` that likely still need a hand edit, and lines the rewrite pushed past 120
    characters (printed, never changed)."""
    if not path.endswith((".py", ".md", ".sh", ".yaml", ".yml")):
        return []
    before = set(old.splitlines())
    return [f"{path}:{n}: {line.strip()[:100]}" for n, line in enumerate(new.splitlines(), 1)
            if LEFTOVER.search(line) or (path.endswith(".py") and len(line) > 120 and line not in before)]


def main(argv: list[str]) -> int:
    check = "--check" in argv
    paths = [a for a in argv if a != "--check"] or subprocess.run(
        ["git", "ls-files"], capture_output=True, text=True, check=True).stdout.split()
    _check_table()
    changed, todo = [], []
    for path in paths:
        if path in SKIP or path.startswith(SKIP_UNDER) or not Path(path).is_file():
            continue
        try:
            text = Path(path).read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue
        new = rewrite_file(path, text)
        if path != "flashdraft/config.py":
            todo.extend(leftovers(path, text, new))
        if new != text:
            changed.append(path)
            if not check:
                Path(path).write_text(new, encoding="utf-8")
    for path in changed:
        print(("would rewrite " if check else "rewrote ") + path)
    if todo:
        print("\ncheck by hand (a section used whole, a dict form, the old classes, a local holding a section, "
              "a rewritten line over 120 characters):")
        print("\n".join(todo))
    return 1 if check and changed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
