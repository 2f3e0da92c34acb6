"""`flashdraft regenerate`: replace every assistant turn by the target model's own reply.

DFlash drafters must imitate the target, not the dataset, so each conversation is replayed
turn by turn: the system and user turns are kept, and before every original assistant turn
(and after a final user turn) the target generates the reply from the history regenerated so
far. Two backends:

- ``http``: an OpenAI-compatible server (vLLM / SGLang ``serve``) at ``base_url``; many
  conversations in flight on a thread pool; transient failures (connection errors, timeouts,
  HTTP 408/409/429/5xx) are retried with exponential backoff and jitter. Only ``base_url``
  is ever contacted.
- ``hf``: in-process Hugging Face ``generate`` in left-padded batches, for small targets and tests.

Output is JSON Lines, one finished conversation per line, appended and flushed as soon as it
is done: ``{"id", "messages", "generation": {settings}, "finish_reasons"}``. A rerun reads the
ids already in the file and skips them, so a killed run resumes without duplicating or losing
conversations (a half-written last line is cut off first). Record ids are the input's ``id``
field, else the record's position in the inputs. The output is itself valid input for
``flashdraft prepare``.
"""

from __future__ import annotations

import collections
import concurrent.futures as cf
import http.client
import json
import os
import random
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path

from flashdraft.data.chat import SampleError, normalize_record
from flashdraft.data.sources import decode_record, iter_records

RETRY_STATUS = {408, 409, 429, 500, 502, 503, 504}
MAX_ERRORS_KEPT = 20


class GenerationError(RuntimeError):
    """A reply could not be generated (permanent HTTP error, or retries exhausted)."""


# ---- resumable output --------------------------------------------------------------------
def load_done_ids(out_path: Path) -> set[str]:
    """Ids of the conversations already in ``out_path``; cuts off a half-written last line."""
    done: set[str] = set()
    if not out_path.exists():
        return done
    good_end = 0
    with open(out_path, "rb") as f:
        for line in f:
            if not line.endswith(b"\n"):
                break  # the process died mid-write: this line is incomplete
            good_end += len(line)
            try:
                done.add(str(json.loads(line)["id"]))
            except (ValueError, KeyError, TypeError):
                continue
    if good_end != out_path.stat().st_size:
        with open(out_path, "r+b") as f:
            f.truncate(good_end)
    return done


class _Appender:
    """Appends one JSON line per finished conversation and flushes it at once (thread-safe)."""

    def __init__(self, path: Path):
        path.parent.mkdir(parents=True, exist_ok=True)
        self._f = open(path, "a", encoding="utf-8")
        self._lock = threading.Lock()

    def write(self, record: dict) -> None:
        line = json.dumps(record, ensure_ascii=False) + "\n"
        with self._lock:
            self._f.write(line)
            self._f.flush()

    def close(self) -> None:
        self._f.close()


# ---- conversation replay -----------------------------------------------------------------
def reply_slots(messages: list[dict]) -> list[dict | None]:
    """The conversation with each assistant turn replaced by None (a reply to generate); a
    trailing user turn gets a None after it. Raises SampleError if there is no user turn."""
    if not any(m["role"] == "user" for m in messages):
        raise SampleError("no_user", "the conversation has no user turn to answer")
    if any(m["role"] == "tool" or m.get("tool_calls") for m in messages):
        raise SampleError("has_tool_calls", "the conversation calls tools: regenerating its replies would need "
                                            "the tools run again on the target's new calls; give it to "
                                            "`flashdraft prepare` as it is")
    slots: list[dict | None] = []
    for m in messages:
        if m["role"] == "assistant":
            if slots and slots[-1] is not None and slots[-1]["role"] != "assistant":
                slots.append(None)
        else:
            slots.append({"role": m["role"], "content": m["content"]})
    if slots[-1] is not None:
        slots.append(None)
    return slots


def _reply_message(content: str, reasoning: str | None) -> dict:
    message = {"role": "assistant", "content": content}
    if reasoning:
        message["reasoning_content"] = reasoning
    return message


# ---- HTTP backend ------------------------------------------------------------------------
def _origin(url: str) -> tuple[str, str, int | None]:
    parts = urllib.parse.urlsplit(url)
    scheme = parts.scheme.lower()
    return scheme, (parts.hostname or "").lower(), parts.port or {"http": 80, "https": 443}.get(scheme)


class RedirectRefused(ValueError):
    """The server redirected to another origin (a ValueError: the fix is the user's --base-url)."""


class _SameOriginRedirects(urllib.request.HTTPRedirectHandler):
    """Follow a redirect only within the origin (scheme, host, port) of ``base_url``: another one
    is refused, so the API key and the conversations go to --base-url and nowhere else."""

    def __init__(self, base_url: str):
        self.origin = _origin(base_url)

    def redirect_request(self, req, fp, code, msg, headers, newurl):
        if _origin(newurl) != self.origin:
            raise RedirectRefused(f"{req.full_url} answered HTTP {code} redirecting to {newurl}, another origin: "
                                  "refused (only --base-url is contacted); point --base-url at the server itself")
        return super().redirect_request(req, fp, code, msg, headers, newurl)


class OpenAIClient:
    """Minimal OpenAI-compatible chat client (stdlib only) with retries and backoff."""

    def __init__(self, base_url: str, *, model: str | None = None, api_key: str | None = None,
                 timeout_s: float = 600.0, max_retries: int = 6, backoff_s: float = 0.5, max_backoff_s: float = 30.0):
        self.base_url = base_url.rstrip("/")
        self.api_key = api_key
        self.timeout_s, self.max_retries = timeout_s, max_retries
        self.backoff_s, self.max_backoff_s = backoff_s, max_backoff_s
        self.num_requests = 0
        self.num_retries = 0
        self._lock = threading.Lock()
        # No proxy handler: requests go to base_url itself and nowhere else, whatever the
        # environment's *_proxy variables say; and no redirect to another origin (urllib would
        # follow it with the Authorization header).
        self._opener = urllib.request.build_opener(urllib.request.ProxyHandler({}), _SameOriginRedirects(self.base_url))
        try:
            self.model = model or self._first_model()
        except GenerationError as exc:
            raise ValueError(f"{self.base_url}: cannot ask the server for its model ({exc}); check that the server "
                             "runs at --base-url, or name the model with --model") from None

    def _request(self, method: str, path: str, payload: dict | None = None) -> dict:
        data = None if payload is None else json.dumps(payload).encode()
        headers = {"Content-Type": "application/json"}
        if self.api_key:
            headers["Authorization"] = f"Bearer {self.api_key}"
        for attempt in range(self.max_retries + 1):
            with self._lock:
                self.num_requests += 1
            try:
                req = urllib.request.Request(self.base_url + path, data=data, headers=headers, method=method)
                with self._opener.open(req, timeout=self.timeout_s) as resp:
                    body = resp.read()
                try:
                    return json.loads(body)
                except ValueError:
                    raise GenerationError(f"{method} {self.base_url + path}: the reply is not JSON "
                                          f"({body[:200].decode('utf-8', 'replace')!r}); is --base-url an "
                                          "OpenAI-compatible server's /v1?") from None
            except urllib.error.HTTPError as exc:
                body = exc.read()[:300].decode("utf-8", "replace")
                if exc.code not in RETRY_STATUS:
                    raise GenerationError(f"{method} {self.base_url + path}: HTTP {exc.code}: {body}") from None
                error = f"HTTP {exc.code}: {body}"
            except (urllib.error.URLError, http.client.HTTPException, ConnectionError, TimeoutError) as exc:
                error = f"{type(exc).__name__}: {exc}"
            if attempt == self.max_retries:
                raise GenerationError(f"{method} {self.base_url + path}: gave up after {attempt + 1} attempts: {error}")
            with self._lock:
                self.num_retries += 1
            # Exponential backoff with jitter, so many threads do not retry in lockstep.
            time.sleep(min(self.max_backoff_s, self.backoff_s * 2 ** attempt) * (0.5 + random.random()))
        raise AssertionError("unreachable")

    def _first_model(self) -> str:
        listing = self._request("GET", "/models")
        models = listing.get("data") if isinstance(listing, dict) else None
        if not models or not isinstance(models[0], dict) or not isinstance(models[0].get("id"), str):
            raise GenerationError(f"{self.base_url}/models lists no model id ({str(listing)[:200]}); pass --model")
        return models[0]["id"]

    def chat(self, messages: list[dict], settings: dict) -> tuple[str, str | None, str]:
        """One reply -> (content, reasoning or None, finish_reason)."""
        payload = {"model": self.model, "messages": messages, "temperature": settings["temperature"],
                   "top_p": settings["top_p"], "max_tokens": settings["max_tokens"]}
        if settings.get("seed") is not None:
            payload["seed"] = settings["seed"]
        if settings.get("enable_thinking") is not None:
            payload["chat_template_kwargs"] = {"enable_thinking": settings["enable_thinking"]}
        response = self._request("POST", "/chat/completions", payload)
        try:
            choice = response["choices"][0]
            message = choice["message"]
        except (KeyError, IndexError, TypeError):
            raise GenerationError(f"unexpected response from {self.base_url}: {str(response)[:300]}") from None
        reasoning = message.get("reasoning_content") or message.get("reasoning")
        return checked_reply(message.get("content"), reasoning, choice.get("finish_reason") or "", self.base_url)


def checked_reply(content, reasoning, finish: str, source: str) -> tuple[str, str | None, str]:
    """A reply as (content, reasoning, finish reason), or GenerationError when it is no reply:
    content that is not text (null, a number, a list) or empty with no reasoning either. Such a
    conversation counts as failed and is retried on the next run, instead of being stored as
    generated and then dropped by prepare."""
    if not isinstance(content, str) and not (content is None and reasoning):
        raise GenerationError(f"{source} returned a reply whose content is {type(content).__name__} "
                              f"({str(content)[:80]!r}), not text")
    if reasoning is not None and not isinstance(reasoning, str):
        raise GenerationError(f"{source} returned reasoning of type {type(reasoning).__name__}, not text")
    content = content or ""
    if not content.strip() and not (reasoning or "").strip():
        raise GenerationError(f"{source} returned an empty reply (finish reason {finish or 'none'!r})")
    return content, reasoning, finish


def _replay(slots: list, generate_one: Callable[[list[dict]], tuple[str, str | None, str]]) -> tuple[list, list]:
    history, finishes = [], []
    for slot in slots:
        if slot is None:
            content, reasoning, finish = generate_one(history)
            history.append(_reply_message(content, reasoning))
            finishes.append(finish)
        else:
            history.append(slot)
    return history, finishes


# ---- HF in-process backend ---------------------------------------------------------------
class HFGenerator:
    """Batched ``generate`` with a Hugging Face causal LM (left padding, stops at eos)."""

    def __init__(self, model, tokenizer, settings: dict):
        import torch

        self.model, self.settings, self.torch = model, settings, torch
        self.tokenizer = tokenizer
        self.pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
        eos = model.generation_config.eos_token_id
        eos = tokenizer.eos_token_id if eos is None else eos
        self.eos = set(eos if isinstance(eos, list | tuple) else [eos])
        if settings.get("seed") is not None:
            torch.manual_seed(int(settings["seed"]))

    def generate(self, histories: list[list[dict]]) -> list[tuple[str, None, str]]:
        torch, s = self.torch, self.settings
        kwargs = {} if s.get("enable_thinking") is None else {"enable_thinking": s["enable_thinking"]}
        prompts = [self.tokenizer.apply_chat_template(h, add_generation_prompt=True, tokenize=True, return_dict=False,
                                                      **kwargs) for h in histories]
        width = max(len(p) for p in prompts)
        ids = torch.full((len(prompts), width), self.pad_id, dtype=torch.long)
        attn = torch.zeros((len(prompts), width), dtype=torch.long)
        for i, p in enumerate(prompts):  # left padding: every prompt ends where generation starts
            ids[i, width - len(p):] = torch.tensor(p)
            attn[i, width - len(p):] = 1
        gen = {"max_new_tokens": s["max_tokens"], "do_sample": s["temperature"] > 0, "pad_token_id": self.pad_id}
        if s["temperature"] > 0:
            gen.update(temperature=s["temperature"], top_p=s["top_p"])
        with torch.no_grad():
            out = self.model.generate(ids, attention_mask=attn, **gen)[:, width:].tolist()
        results = []
        for row in out:
            finish = "length"
            for k, t in enumerate(row):
                if t in self.eos:
                    row, finish = row[:k], "stop"
                    break
            results.append((self.tokenizer.decode(row, skip_special_tokens=True), None, finish))
        return results


# ---- driver ------------------------------------------------------------------------------
def _pending(inputs, split, done: set, counts, invalid, errors) -> Iterator[tuple[str, str, list]]:
    """(id, where, reply slots) of every valid, not yet generated input conversation."""
    for index, (where, payload) in enumerate(iter_records(inputs, split)):
        counts["conversations_in"] += 1
        try:
            record = decode_record(where, payload)
            rid = str(record["id"]) if isinstance(record, dict) and record.get("id") is not None else str(index)
            if rid in done:
                counts["skipped_done"] += 1
                continue
            normal = normalize_record(record, where, require_final_assistant=False)
            if "messages" not in normal:
                raise SampleError("bad_shape", f"{where}: templated text cannot be regenerated; give messages")
            slots = reply_slots(normal["messages"])
        except SampleError as exc:
            invalid[exc.reason] += 1
            if len(errors) < MAX_ERRORS_KEPT:
                errors.append(f"{where}: {exc}" if not str(exc).startswith(where) else str(exc))
            continue
        done.add(rid)  # duplicate ids in the input are generated once
        yield rid, where, slots


def regenerate(inputs, out_path, *, backend: str = "http", base_url: str | None = None, model: str | None = None,
               api_key: str | None = None, hf_model=None, hf_tokenizer=None, model_dir: str | None = None,
               temperature: float = 0.0, top_p: float = 1.0, max_tokens: int = 1024, seed: int | None = None,
               enable_thinking: bool | None = None, concurrency: int = 64, batch_size: int = 16,
               max_retries: int = 6, backoff_s: float = 0.5, timeout_s: float = 600.0, split: str | None = None,
               progress: bool = True, log=print) -> dict:
    """Regenerate the assistant turns of ``inputs`` into the JSONL file ``out_path``; returns a summary.

    ``backend="http"`` needs ``base_url`` (e.g. ``http://127.0.0.1:8000/v1``; ``model`` defaults
    to the server's first model); ``backend="hf"`` needs ``hf_model`` + ``hf_tokenizer`` or
    ``model_dir``. ``temperature`` 0 is greedy. ``enable_thinking`` is passed to the chat
    template (must match serving; None: the template default). Conversations already in
    ``out_path`` are skipped. A conversation whose generation fails is not written (counted in
    ``failed``; a rerun retries it); bad input records are counted by reason, never fatal.
    """
    t0 = time.perf_counter()
    inputs = [str(i) for i in ([inputs] if isinstance(inputs, str | os.PathLike) else inputs)]
    out_path = Path(out_path)
    if out_path.is_dir():
        raise ValueError(f"--out {out_path} is a directory; give the JSONL file to write "
                         f"(e.g. {out_path / 'regen.jsonl'})")
    settings = {"backend": backend, "temperature": float(temperature), "top_p": float(top_p),
                "max_tokens": int(max_tokens), "seed": seed, "enable_thinking": enable_thinking}
    client, generator = _make_backend(settings, base_url=base_url, model=model, api_key=api_key, hf_model=hf_model,
                                      hf_tokenizer=hf_tokenizer, model_dir=model_dir, max_retries=max_retries,
                                      backoff_s=backoff_s, timeout_s=timeout_s)

    done = load_done_ids(out_path)
    counts: collections.Counter = collections.Counter()
    invalid: collections.Counter = collections.Counter()
    errors: list[str] = []
    appender = _Appender(out_path)
    from tqdm import tqdm

    bar = tqdm(desc="regenerate", unit=" chats", disable=not progress, mininterval=0.5)

    def finish(rid: str, where: str, messages: list, finishes: list) -> None:
        appender.write({"id": rid, "messages": messages, "generation": settings, "finish_reasons": finishes,
                        "source": where})
        counts["generated"] += 1
        bar.update(1)

    def fail(where: str, exc: Exception) -> None:
        counts["failed"] += 1
        if len(errors) < MAX_ERRORS_KEPT:
            errors.append(f"{where}: {exc}")

    pending = _pending(inputs, split, done, counts, invalid, errors)
    try:
        if backend == "http":
            _run_http(pending, client, settings, concurrency, finish, fail)
        else:
            _run_hf(pending, generator, batch_size, finish, fail)
    finally:
        bar.close()
        appender.close()
    summary = {"conversations_in": counts["conversations_in"], "skipped_done": counts["skipped_done"],
               "generated": counts["generated"], "failed": counts["failed"], "invalid": dict(sorted(invalid.items())),
               "errors": errors, "seconds": time.perf_counter() - t0, "out_path": str(out_path), "generation": settings}
    if backend == "http":
        summary.update(requests=client.num_requests, retries=client.num_retries)
    log(format_summary(summary))
    return summary


def _make_backend(settings: dict, *, base_url, model, api_key, hf_model, hf_tokenizer, model_dir, max_retries,
                  backoff_s, timeout_s) -> tuple[OpenAIClient | None, HFGenerator | None]:
    """(client, None) for ``settings["backend"] == "http"``, (None, generator) for "hf"; records the
    model (and the server's base_url) in ``settings``, which every output line carries."""
    backend = settings["backend"]
    if backend == "http":
        if not base_url:
            raise ValueError("the http backend needs --base-url, e.g. http://127.0.0.1:8000/v1")
        client = OpenAIClient(base_url, model=model, api_key=api_key, timeout_s=timeout_s,
                              max_retries=max_retries, backoff_s=backoff_s)
        settings["model"] = client.model
        settings["base_url"] = client.base_url
        return client, None
    if backend == "hf":
        if hf_model is None:
            if not model_dir:
                raise ValueError("the hf backend needs --model-dir (a local Hugging Face model directory)")
            from transformers import AutoModelForCausalLM, AutoTokenizer

            hf_tokenizer = hf_tokenizer or AutoTokenizer.from_pretrained(model_dir)
            hf_model = AutoModelForCausalLM.from_pretrained(model_dir, dtype="auto").eval()
        settings["model"] = model or model_dir or getattr(hf_model.config, "_name_or_path", "") or "in-process"
        return None, HFGenerator(hf_model, hf_tokenizer, settings)
    raise ValueError(f"unknown backend {backend!r}; use http or hf")


def _run_http(pending, client: OpenAIClient, settings: dict, concurrency: int, finish, fail) -> None:
    """Replay conversations on a thread pool, ``concurrency`` workers, each conversation one task."""
    with cf.ThreadPoolExecutor(max_workers=concurrency, thread_name_prefix="regenerate") as pool:
        in_flight: dict = {}
        for rid, where, slots in pending:
            in_flight[pool.submit(_replay, slots, lambda h: client.chat(h, settings))] = (rid, where)
            if len(in_flight) >= 2 * concurrency:  # bounded: inputs are streamed, not queued whole
                _drain(in_flight, finish, fail, cf.FIRST_COMPLETED)
        _drain(in_flight, finish, fail, cf.ALL_COMPLETED)


def _drain(in_flight: dict, finish, fail, return_when) -> None:
    done, _ = cf.wait(list(in_flight), return_when=return_when)
    for future in done:
        rid, where = in_flight.pop(future)
        try:
            messages, finishes = future.result()
        except Exception as exc:  # one conversation's failure is counted and reported; the run goes on
            fail(where, exc)
            continue
        finish(rid, where, messages, finishes)


def _run_hf(pending, generator: HFGenerator, batch_size: int, finish, fail) -> None:
    """Continuous batching over conversations: each round generates the next reply of up to
    ``batch_size`` active conversations; finished ones are written and replaced from the input."""
    active: list[dict] = []
    source = iter(pending)
    exhausted = False
    while True:
        while not exhausted and len(active) < batch_size:
            item = next(source, None)
            if item is None:
                exhausted = True
                break
            rid, where, slots = item
            state = {"rid": rid, "where": where, "slots": collections.deque(slots), "history": [], "finishes": []}
            _advance(state)
            active.append(state)
        if not active:
            return
        try:
            replies = generator.generate([s["history"] for s in active])
        except (RuntimeError, ValueError) as exc:  # e.g. out of memory: fail this batch, keep going
            for s in active:
                fail(s["where"], exc)
            active = []
            continue
        still = []
        for state, (content, reasoning, fin) in zip(active, replies):
            try:
                content, reasoning, fin = checked_reply(content, reasoning, fin, "the model")
            except GenerationError as exc:
                fail(state["where"], exc)
                continue
            state["history"].append(_reply_message(content, reasoning))
            state["finishes"].append(fin)
            _advance(state)
            if state["waiting"]:
                still.append(state)
            else:
                finish(state["rid"], state["where"], state["history"], state["finishes"])
        active = still


def _advance(state: dict) -> None:
    """Move given (non-reply) turns into the history up to the next reply slot, and consume
    that slot: ``state["waiting"]`` is then True, or False when the conversation is complete."""
    slots = state["slots"]
    while slots and slots[0] is not None:
        state["history"].append(slots.popleft())
    state["waiting"] = bool(slots)
    if slots:
        slots.popleft()


def format_summary(s: dict) -> str:
    line = (f"regenerate: {s['generated']:,} generated, {s['skipped_done']:,} already done, {s['failed']:,} failed, "
            f"of {s['conversations_in']:,} conversations -> {s['out_path']} ({s['seconds']:.1f} s)")
    lines = [line]
    if "requests" in s:
        lines.append(f"  {s['requests']:,} requests, {s['retries']:,} retried")
    if s["invalid"]:
        lines.append("  invalid: " + ", ".join(f"{k} {v:,}" for k, v in s["invalid"].items()))
    lines += [f"    {e}" for e in s["errors"][:5]]
    return "\n".join(lines)


# ---- CLI ---------------------------------------------------------------------------------
def add_arguments(parser) -> None:
    parser.add_argument("inputs", nargs="+", help="JSONL/JSON/parquet files, dirs, globs or HF dataset dirs")
    parser.add_argument("--out", required=True, help="output JSONL (appended to; finished ids are skipped)")
    parser.add_argument("--backend", choices=["http", "hf"], default="http")
    parser.add_argument("--base-url", help="OpenAI-compatible server, e.g. http://127.0.0.1:8000/v1")
    parser.add_argument("--model", help="model name sent to the server (default: its first model)")
    parser.add_argument("--api-key-env", default="OPENAI_API_KEY", help="env var holding the server's API key, if any")
    parser.add_argument("--model-dir", help="local HF model dir (hf backend)")
    parser.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--max-tokens", type=int, default=1024, help="max new tokens per reply")
    parser.add_argument("--seed", type=int, default=None)
    parser.add_argument("--thinking", choices=["default", "on", "off"], default="default",
                        help="the target's serving mode, passed to the template as enable_thinking")
    parser.add_argument("--concurrency", type=int, default=64, help="conversations in flight (http)")
    parser.add_argument("--batch-size", type=int, default=16, help="generate batch size (hf)")
    parser.add_argument("--max-retries", type=int, default=6)
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds per HTTP request")
    parser.add_argument("--split", default=None, help="split of a HF DatasetDict (default: train)")
    parser.add_argument("--no-progress", dest="progress", action="store_false")


def run(args) -> int:
    from flashdraft.data.prepare import thinking_flag

    summary = regenerate(
        args.inputs, args.out, backend=args.backend, base_url=args.base_url, model=args.model,
        api_key=os.environ.get(args.api_key_env) or None, model_dir=args.model_dir, temperature=args.temperature,
        top_p=args.top_p, max_tokens=args.max_tokens, seed=args.seed, enable_thinking=thinking_flag(args.thinking),
        concurrency=args.concurrency, batch_size=args.batch_size, max_retries=args.max_retries, timeout_s=args.timeout,
        split=args.split, progress=args.progress)
    return 1 if summary["failed"] else 0
