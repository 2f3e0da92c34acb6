"""`flashdraft regenerate` against a real OpenAI-compatible server on 127.0.0.1 and in-process HF."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from flashdraft.data.chat import SampleError, normalize_record
from flashdraft.data.prepare import prepare
from flashdraft.data.regenerate import load_done_ids, regenerate, reply_slots
from flashdraft.toy import ToyOpenAIServer, synthetic_conversations, tiny_causal_lm, train_toy_tokenizer

REPO = Path(__file__).resolve().parents[1]
MAX_TOKENS = 6


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    # Tiny models: intra-op threads only add synchronisation cost (and contend on shared CPUs).
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def target():
    tok = train_toy_tokenizer(template="qwen3")
    return tiny_causal_lm(tok, num_layers=2, hidden=32), tok


def write_jsonl(path, records):
    with open(path, "w") as f:
        for r in records:
            f.write(json.dumps(r) + "\n")


def read_out(path):
    return [json.loads(line) for line in open(path)]


def test_reply_slots_turn_by_turn():
    chat = [{"role": "system", "content": "s"}, {"role": "user", "content": "a"}, {"role": "assistant", "content": "x"},
            {"role": "user", "content": "b"}]
    assert reply_slots(chat) == [chat[0], chat[1], None, chat[3], None]


def test_a_conversation_with_tool_calls_is_not_regenerated_but_named():
    record = {"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": None, "tool_calls": [
        {"function": {"name": "f", "arguments": "{}"}}]}, {"role": "tool", "content": "r"},
        {"role": "assistant", "content": "done"}]}
    with pytest.raises(SampleError) as err:
        reply_slots(normalize_record(record, "chats.jsonl:4", require_final_assistant=False)["messages"])
    assert err.value.reason == "has_tool_calls" and "flashdraft prepare" in str(err.value)


def test_http_concurrent_with_retries_matches_in_process_greedy(target, tmp_path):
    model, tok = target
    records = synthetic_conversations(16, seed=5, max_turns=2)
    records[2]["messages"] = records[2]["messages"][:-1]  # ends with a user turn: its reply is generated
    write_jsonl(tmp_path / "in.jsonl", records)
    with ToyOpenAIServer(model, tok, fail_every=4, delay_s=0.01) as server:
        s = regenerate([tmp_path / "in.jsonl"], tmp_path / "http.jsonl", base_url=server.url, max_tokens=MAX_TOKENS,
                       concurrency=8, backoff_s=0.01, progress=False, log=lambda *_: None)
        assert server.num_failed > 0  # errors were injected ...
    assert s["retries"] == server.num_failed and s["failed"] == 0  # ... and every one was retried
    assert s["generated"] == 16
    http = {r["id"]: r for r in read_out(tmp_path / "http.jsonl")}
    assert sorted(http) == sorted(r["id"] for r in records)
    for r in records:
        out = http[r["id"]]
        users = [m["content"] for m in r["messages"] if m["role"] == "user"]
        assert [m["content"] for m in out["messages"] if m["role"] == "user"] == users
        assert [m["role"] for m in out["messages"]][-1] == "assistant"
        assert out["generation"]["temperature"] == 0.0 and out["generation"]["max_tokens"] == MAX_TOKENS
    s2 = regenerate([tmp_path / "in.jsonl"], tmp_path / "hf.jsonl", backend="hf", hf_model=model, hf_tokenizer=tok,
                    max_tokens=MAX_TOKENS, batch_size=5, progress=False, log=lambda *_: None)
    assert s2["generated"] == 16
    hf = {r["id"]: r["messages"] for r in read_out(tmp_path / "hf.jsonl")}
    assert hf == {k: v["messages"] for k, v in http.items()}  # same greedy replies, batched or not


@pytest.mark.slow
def test_killed_run_resumes_without_duplicates_or_losses(target, tmp_path):
    model, tok = target
    records = synthetic_conversations(24, seed=7, max_turns=1)
    write_jsonl(tmp_path / "in.jsonl", records)
    out = tmp_path / "out.jsonl"
    with ToyOpenAIServer(model, tok, delay_s=0.05) as server:
        env = dict(os.environ, PYTHONPATH=str(REPO))
        proc = subprocess.Popen(
            [sys.executable, "-m", "flashdraft.cli", "regenerate", str(tmp_path / "in.jsonl"), "--out", str(out),
             "--base-url", server.url, "--max-tokens", str(MAX_TOKENS), "--concurrency", "2", "--no-progress"],
            env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.time() + 60
        while time.time() < deadline and (not out.exists() or len(out.read_bytes().splitlines()) < 4):
            time.sleep(0.05)
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        first = len(read_out(out))
        assert 4 <= first < 24, "the run must be killed part-way"
        with open(out, "ab") as f:  # and as if it died in the middle of a write
            f.write(b'{"id": "s23", "messages": [')
        assert len(load_done_ids(out)) == first and out.read_bytes().endswith(b"\n")
        s = regenerate([tmp_path / "in.jsonl"], out, base_url=server.url, max_tokens=MAX_TOKENS, concurrency=4,
                       progress=False, log=lambda *_: None)
    assert s["skipped_done"] == first and s["generated"] == 24 - first
    ids = [r["id"] for r in read_out(out)]
    assert sorted(ids) == sorted(r["id"] for r in records) and len(ids) == len(set(ids))


def test_bad_records_are_skipped_and_output_feeds_prepare(target, tmp_path):
    model, tok = target
    good = synthetic_conversations(3, seed=9, max_turns=1)
    lines = [json.dumps(r).encode() for r in good] + [
        b"{oops", b'{"messages": [{"role": "alien", "content": "x"}]}', b'{"text": "\xff"}',
        json.dumps({"messages": [{"role": "system", "content": "only a system prompt"}]}).encode()]
    (tmp_path / "in.jsonl").write_bytes(b"\n".join(lines) + b"\n")
    s = regenerate([tmp_path / "in.jsonl"], tmp_path / "out.jsonl", backend="hf", hf_model=model, hf_tokenizer=tok,
                   max_tokens=MAX_TOKENS, temperature=0.8, seed=1, progress=False, log=lambda *_: None)
    assert s["generated"] == 3 and s["invalid"] == {"bad_json": 1, "bad_utf8": 1, "no_user": 1, "unknown_role": 1}
    assert read_out(tmp_path / "out.jsonl")[0]["generation"]["temperature"] == 0.8
    tok.save_pretrained(tmp_path / "tok")
    p = prepare([tmp_path / "out.jsonl"], tmp_path / "tok", tmp_path / "shard", max_length=512, min_supervised=1,
                num_workers=1, progress=False, log=lambda *_: None)
    assert p["samples_in"] == 3 and p["samples"] + sum(p["dropped"].values()) == 3


def test_the_http_client_connects_only_to_the_configured_url(target, tmp_path, monkeypatch):
    """Security: every socket the client opens goes to base_url's host:port -- proxies from the
    environment are ignored (samples must not leave through them)."""
    import socket
    from urllib.parse import urlsplit

    model, tok = target
    write_jsonl(tmp_path / "in.jsonl", synthetic_conversations(4, seed=9, max_turns=1))
    for var in ("HTTP_PROXY", "HTTPS_PROXY", "ALL_PROXY", "http_proxy", "https_proxy", "all_proxy"):
        monkeypatch.setenv(var, "http://127.0.0.2:9")  # a "proxy" that must never be contacted
    monkeypatch.delenv("NO_PROXY", raising=False)
    monkeypatch.delenv("no_proxy", raising=False)
    seen = []
    real_connect = socket.socket.connect

    def recording_connect(self, address):
        seen.append(address[:2])
        return real_connect(self, address)

    monkeypatch.setattr(socket.socket, "connect", recording_connect)
    with ToyOpenAIServer(model, tok) as server:
        s = regenerate([tmp_path / "in.jsonl"], tmp_path / "out.jsonl", base_url=server.url, max_tokens=MAX_TOKENS,
                       concurrency=2, progress=False, log=lambda *_: None)
        url = urlsplit(server.url)
    assert s["generated"] == 4
    assert seen and set(seen) == {(url.hostname, url.port)}


class _Server:
    """A real HTTP server on 127.0.0.1 answering with ``respond(handler) -> (status, headers, body)``,
    recording every request's path and headers."""

    def __init__(self, respond):
        import threading
        from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

        self.requests: list[tuple[str, dict]] = []
        server = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def _answer(self):
                length = int(self.headers.get("Content-Length") or 0)
                self.rfile.read(length)
                server.requests.append((self.path, dict(self.headers)))
                status, headers, body = respond(self)
                self.send_response(status)
                for k, v in headers.items():
                    self.send_header(k, v)
                data = json.dumps(body).encode() if body is not None else b""
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            do_GET = do_POST = _answer

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}/v1"
        # polled every 10 ms: shutdown() waits for the next poll (0.5 s by default, per server)
        threading.Thread(target=self.httpd.serve_forever, kwargs={"poll_interval": 0.01}, daemon=True).start()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.httpd.shutdown()
        self.httpd.server_close()


def test_a_redirect_to_another_origin_is_refused_and_never_gets_the_key():
    from flashdraft.data.regenerate import OpenAIClient, RedirectRefused

    models = {"data": [{"id": "toy"}]}
    with _Server(lambda h: (200, {}, models)) as elsewhere:
        with _Server(lambda h: (302, {"Location": elsewhere.url + "/models"}, None)) as server:
            with pytest.raises(RedirectRefused, match=r"(?s)redirecting to http://127\.0\.0\.1:\d+/v1/models.*another "
                                                      r"origin.*refused.*only --base-url is contacted"):
                OpenAIClient(server.url, api_key="secret-key", max_retries=0)
            assert server.requests[0][1].get("Authorization") == "Bearer secret-key"
        assert elsewhere.requests == []  # neither the key nor anything else went there
    # a redirect within the same origin is followed
    with _Server(lambda h: (200, {}, models) if h.path == "/v1/models/" else (301, {"Location": "/v1/models/"},
                                                                             None)) as server:
        assert OpenAIClient(server.url, api_key="k", max_retries=0).model == "toy"


@pytest.mark.parametrize("content", ["", None, 3, ["a", "list"], "  \n"])
def test_a_reply_that_is_not_text_fails_the_conversation_and_a_rerun_retries_it(tmp_path, content):
    records = [{"id": "a", "messages": [{"role": "user", "content": "hi"}]},
               {"id": "b", "messages": [{"role": "user", "content": "bad"}]}]
    write_jsonl(tmp_path / "in.jsonl", records)
    state = {"bad": content}
    seen = []

    def answer(handler):
        if handler.command == "GET":
            return 200, {}, {"data": [{"id": "toy"}]}
        seen.append(len(seen))
        # the first request of each run gets the bad reply, every other one a good one
        reply = state["bad"] if len(seen) == 1 else "fine"
        return 200, {}, {"choices": [{"message": {"content": reply}, "finish_reason": "stop"}]}

    with _Server(answer) as server:
        first = regenerate([tmp_path / "in.jsonl"], tmp_path / "out.jsonl", base_url=server.url, concurrency=1,
                           max_retries=0, progress=False, log=lambda *_: None)
    assert first["generated"] == 1 and first["failed"] == 1
    assert "not text" in first["errors"][0] or "empty reply" in first["errors"][0]
    kept = read_out(tmp_path / "out.jsonl")
    assert len(kept) == 1 and kept[0]["messages"][-1]["content"] == "fine"
    seen.clear()
    state["bad"] = "fine now"
    with _Server(answer) as server:
        again = regenerate([tmp_path / "in.jsonl"], tmp_path / "out.jsonl", base_url=server.url, concurrency=1,
                           max_retries=0, progress=False, log=lambda *_: None)
    assert again["skipped_done"] == 1 and again["generated"] == 1 and again["failed"] == 0  # the failed one, retried
    assert sorted(r["id"] for r in read_out(tmp_path / "out.jsonl")) == ["a", "b"]


def test_server_and_output_mistakes_are_one_line_errors_naming_the_fix(tmp_path):
    from flashdraft.data.regenerate import OpenAIClient

    write_jsonl(tmp_path / "in.jsonl", [{"id": "a", "messages": [{"role": "user", "content": "hi"}]}])
    with pytest.raises(ValueError, match=r"--out .* is a directory; give the JSONL file to write"):
        regenerate([tmp_path / "in.jsonl"], tmp_path, base_url="http://127.0.0.1:9/v1", progress=False,
                   log=lambda *_: None)
    with _Server(lambda h: (200, {}, {"data": [{"name": "no id"}]})) as server:
        with pytest.raises(ValueError, match=r"lists no model id .*pass --model"):
            OpenAIClient(server.url, max_retries=0)
    with pytest.raises(ValueError, match=r"(?s)cannot ask the server for its model.*--base-url.*--model"):
        OpenAIClient("http://127.0.0.1:9/v1", max_retries=1, backoff_s=0.01)  # nothing listens on port 9

    with _Server(lambda h: (200, {}, None)) as server:  # an empty body where JSON should be
        with pytest.raises(ValueError, match=r"the reply is not JSON .*is --base-url an OpenAI-compatible server"):
            OpenAIClient(server.url, max_retries=0)


def test_prepare_refuses_a_tokenizer_path_that_is_a_file_or_missing(tmp_path):
    from flashdraft.data.prepare import load_tokenizer

    (tmp_path / "tokenizer.json").write_text("{}")
    with pytest.raises(ValueError, match=r"--tokenizer .*tokenizer.json: a file; give the target model's directory"):
        load_tokenizer(tmp_path / "tokenizer.json")
    with pytest.raises(ValueError, match=r"--tokenizer .*typo: no such directory"):
        load_tokenizer(tmp_path / "typo")
