"""Tiny, locally built tokenizers, models and an OpenAI-compatible server for tests and the quickstart.

Nothing here downloads anything: ``train_toy_tokenizer`` trains a byte-level BPE with
``tokenizers`` on a small corpus and gives it a real chat template in one of three styles,
``tiny_causal_lm`` builds a randomly initialised Qwen3 / Llama / Qwen3.5 / Qwen3-Next causal LM
from its config (``causal_lm_config``: the config alone), and
``ToyOpenAIServer`` serves such a model on 127.0.0.1 through ``/v1/chat/completions`` and
``/v1/completions`` (with optional error injection, for retry tests).

The chat templates are written for this project; they render the same token layout as the
model families they are named after (Qwen3 ChatML with ``<think>`` blocks and the
``enable_thinking`` switch, Llama 3 headers with ``<|eot_id|>``), plus a third style whose
assistant turns carry ``{% generation %}`` markers.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

MASK_TOKEN = "<|MASK|>"

# Qwen3 style: ChatML. Assistant turns after the last user message keep their reasoning inside
# <think>...</think>; earlier assistant turns are rendered without it (as Qwen3 does), and the
# generation prompt carries an empty think block when enable_thinking is false.
QWEN3_TEMPLATE = """\
{%- set ns = namespace(last_user=-1) -%}
{%- for m in messages -%}{%- if m.role == 'user' -%}{%- set ns.last_user = loop.index0 -%}{%- endif -%}{%- endfor -%}
{%- for m in messages -%}
{%- if m.role == 'assistant' -%}
{%- set body = m.content -%}
{%- set thought = '' -%}
{%- if m.reasoning_content is defined and m.reasoning_content is not none -%}
{%- set thought = m.reasoning_content -%}
{%- elif '</think>' in body -%}
{%- set thought = body.split('</think>')[0].split('<think>')[-1].strip('\\n') -%}
{%- set body = body.split('</think>')[-1].lstrip('\\n') -%}
{%- endif -%}
{%- if loop.index0 > ns.last_user and (loop.last or thought) -%}
{{- '<|im_start|>assistant\\n<think>\\n' + thought.strip('\\n') + '\\n</think>\\n\\n' \
+ body.lstrip('\\n') + '<|im_end|>\\n' -}}
{%- else -%}
{{- '<|im_start|>assistant\\n' + body + '<|im_end|>\\n' -}}
{%- endif -%}
{%- else -%}
{{- '<|im_start|>' + m.role + '\\n' + m.content + '<|im_end|>\\n' -}}
{%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt -%}
{{- '<|im_start|>assistant\\n' -}}
{%- if enable_thinking is defined and enable_thinking is false -%}{{- '<think>\\n\\n</think>\\n\\n' -}}{%- endif -%}
{%- endif -%}"""

# Llama 3 style: BOS, role headers, trimmed content, <|eot_id|> ends every turn. Like Llama 3.1,
# a system header is always emitted (a default one when the chat has no system prompt), so the
# rendered text contains template text that is in no message.
LLAMA3_TEMPLATE = """\
{{- bos_token -}}
{%- if messages and messages[0].role == 'system' -%}
{%- set system = messages[0].content | trim -%}{%- set rest = messages[1:] -%}
{%- else -%}
{%- set system = 'You are a helpful assistant.' -%}{%- set rest = messages -%}
{%- endif -%}
{{- '<|start_header_id|>system<|end_header_id|>\\n\\n' + system + '<|eot_id|>' -}}
{%- for m in rest -%}
{{- '<|start_header_id|>' + m.role + '<|end_header_id|>\\n\\n' + (m.content | trim) + '<|eot_id|>' -}}
{%- endfor -%}
{%- if add_generation_prompt -%}{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' -}}{%- endif -%}"""

# A template that marks what the assistant generates with {% generation %}, so the tokenizer's
# own assistant mask (return_assistant_tokens_mask) applies and can be checked against ours.
GENERATION_TEMPLATE = """\
{%- for m in messages -%}
{%- if m.role == 'assistant' -%}
{{- '<|assistant|>\\n' -}}{% generation %}{{- m.content + '<|end|>' -}}{% endgeneration %}{{- '\\n' -}}
{%- else -%}
{{- '<|' + m.role + '|>\\n' + m.content + '<|end|>\\n' -}}
{%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt -%}{{- '<|assistant|>\\n' -}}{%- endif -%}"""

_STYLES = {
    # template: (chat template, special tokens, plain added tokens, bos, eos, pad)
    "qwen3": (QWEN3_TEMPLATE, ["<|endoftext|>", "<|im_start|>", "<|im_end|>"], ["<think>", "</think>"],
              None, "<|im_end|>", "<|endoftext|>"),
    "llama3": (LLAMA3_TEMPLATE, ["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>",
                                 "<|end_header_id|>", "<|eot_id|>"], [],
               "<|begin_of_text|>", "<|eot_id|>", "<|end_of_text|>"),
    "generation": (GENERATION_TEMPLATE, ["<|endoftext|>", "<|system|>", "<|user|>", "<|assistant|>", "<|end|>"], [],
                   None, "<|end|>", "<|endoftext|>"),
}

DEFAULT_CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "Speculative decoding drafts several tokens and lets the target verify them in one pass.",
    "What is the capital of France? The capital of France is Paris.",
    "Let me think step by step: 2 + 2 = 4, and 4 * 3 = 12.",
    "def add(a, b):\n    return a + b\n",
    "You are a helpful assistant. Answer briefly and clearly.",
    "Hello! How can I help you today? Thanks, that was useful.",
]


def train_toy_tokenizer(texts: Iterable[str] | None = None, vocab_size: int = 512, *, template: str = "qwen3"):
    """Train a byte-level BPE on ``texts`` and wrap it as a chat-ready Hugging Face tokenizer.

    Returns a ``PreTrainedTokenizerFast`` (transformers' tokenizers backend) with the special
    tokens of ``template`` ("qwen3", "llama3" or "generation"), DFlash's ``<|MASK|>`` token
    added last, pad/eos (and bos for llama3) set, and ``chat_template`` set, so
    ``apply_chat_template`` works and ``save_pretrained`` / ``AutoTokenizer.from_pretrained``
    round-trip. ``len(tokenizer)`` counts every id, added tokens included. Byte-level, so any
    UTF-8 text encodes. Trains in well under a second on the default corpus.
    """
    if template not in _STYLES:
        raise ValueError(f"unknown template style {template!r}; use one of {sorted(_STYLES)}")
    chat_template, specials, plain_added, bos, eos, pad = _STYLES[template]
    return chat_tokenizer(chat_template, specials, plain_added, bos=bos, eos=eos, pad=pad, texts=texts,
                          vocab_size=vocab_size)


def chat_tokenizer(chat_template: str, special_tokens: list[str], plain_tokens: list[str] = (), *, eos: str,
                   pad: str | None = None, bos: str | None = None, texts: Iterable[str] | None = None,
                   vocab_size: int = 512):
    """A byte-level BPE tokenizer for any chat template: ``special_tokens`` (the first ones
    in the vocabulary, special as in the real model's tokenizer), ``plain_tokens`` added but
    not special (as Qwen3 adds ``<think>``), ``<|MASK|>`` last, and the template set."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    texts = list(texts) if texts is not None else list(DEFAULT_CORPUS)
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=list(special_tokens),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    kwargs = {"eos_token": eos, "pad_token": pad or eos}
    if bos:
        kwargs["bos_token"] = bos
    hf = PreTrainedTokenizerFast(tokenizer_object=tok, **kwargs)
    if plain_tokens:
        hf.add_tokens(list(plain_tokens), special_tokens=False)
    hf.add_tokens([MASK_TOKEN], special_tokens=True)
    hf.chat_template = chat_template
    return hf


# arch -> (config class, model class), both in transformers.
_ARCHS = {
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM"),
    "llama": ("LlamaConfig", "LlamaForCausalLM"),
    "qwen3_5": ("Qwen3_5TextConfig", "Qwen3_5ForCausalLM"),
    "qwen3_next": ("Qwen3NextConfig", "Qwen3NextForCausalLM"),
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM"),
}


def _config_and_ids(tokenizer_or_vocab_size, arch: str, num_layers: int, hidden: int, num_heads: int,
                    num_kv_heads: int, intermediate: int | None, max_position_embeddings: int, head_dim: int | None,
                    overrides: dict):
    """(config, model class, the tokenizer's bos/eos/pad ids) of ``causal_lm_config``."""
    import transformers

    if arch not in _ARCHS:
        raise ValueError(f"unknown arch {arch!r}; use one of {', '.join(_ARCHS)}")
    if isinstance(tokenizer_or_vocab_size, int):
        vocab_size, ids = tokenizer_or_vocab_size, {}
    else:
        tk = tokenizer_or_vocab_size
        vocab_size = len(tk)
        ids = {k: getattr(tk, k) for k in ("bos_token_id", "eos_token_id", "pad_token_id")
               if getattr(tk, k, None) is not None}
    head_dim = head_dim or hidden // num_heads
    fields = dict(
        vocab_size=vocab_size, hidden_size=hidden, intermediate_size=intermediate or 2 * hidden,
        num_hidden_layers=num_layers, num_attention_heads=num_heads, num_key_value_heads=num_kv_heads,
        head_dim=head_dim, max_position_embeddings=max_position_embeddings,
        tie_word_embeddings=False, **ids,
    )
    if arch in ("qwen3_5", "qwen3_next"):
        # Qwen3.5's pattern (full attention every 4th layer), and always in the last layer: an
        # all-linear stack has no attention layer to tell its cache length (transformers refuses).
        fields["layer_types"] = ["full_attention" if i % 4 == 3 or i == num_layers - 1 else "linear_attention"
                                 for i in range(num_layers)]
        fields.update(linear_num_key_heads=num_kv_heads, linear_num_value_heads=num_heads,
                      linear_key_head_dim=head_dim, linear_value_head_dim=head_dim)
    if arch == "qwen3_next":  # sparse MoE in every layer: 2 of 4 experts per token, plus the shared expert
        fields.update(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=hidden // 2,
                      shared_expert_intermediate_size=hidden // 2)
    if arch == "qwen3_moe":  # sparse MoE in every layer: 2 of 4 experts per token
        fields.update(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=hidden // 2, decoder_sparse_step=1,
                      mlp_only_layers=[])
    fields.update(overrides)
    config_name, model_name = _ARCHS[arch]
    return getattr(transformers, config_name)(**fields), getattr(transformers, model_name), ids


def causal_lm_config(tokenizer_or_vocab_size, arch: str = "qwen3", num_layers: int = 4, hidden: int = 64,
                     num_heads: int = 4, num_kv_heads: int = 2, intermediate: int | None = None,
                     max_position_embeddings: int = 2048, *, head_dim: int | None = None, **overrides):
    """The Hugging Face config ``tiny_causal_lm`` builds its model from, without the weights (a
    config of any size is cheap; the weights of a large one are not).

    ``arch``: "qwen3" (Qwen3Config), "llama" (LlamaConfig), "qwen3_5" (Qwen3_5TextConfig, the
    hybrid text model: gated delta-net linear attention, full attention in every fourth layer and
    the last), "qwen3_next" (Qwen3NextConfig: the same layer pattern, sparse-MoE MLPs with 4
    experts, 2 per token, and a shared expert) or "qwen3_moe" (Qwen3MoeConfig: every layer's MLP
    sparse, 4 experts, 2 per token). ``vocab_size`` is ``len(tokenizer)`` (added tokens
    included) when a tokenizer is given; bos/eos/pad ids are copied from it. ``head_dim`` defaults
    to ``hidden // num_heads``, ``intermediate`` to ``2 * hidden``; input and output embeddings are
    untied. ``overrides`` are further config fields, and replace any of the above (e.g.
    ``rope_parameters``, ``tie_word_embeddings``, ``layer_types``).
    """
    config, _, _ = _config_and_ids(tokenizer_or_vocab_size, arch, num_layers, hidden, num_heads, num_kv_heads,
                                   intermediate, max_position_embeddings, head_dim, overrides)
    return config


def tiny_causal_lm(tokenizer_or_vocab_size, arch: str = "qwen3", num_layers: int = 4, hidden: int = 64,
                   num_heads: int = 4, num_kv_heads: int = 2, intermediate: int | None = None,
                   max_position_embeddings: int = 2048, seed: int = 0, *, head_dim: int | None = None,
                   dtype=None, **overrides):
    """A randomly initialised causal LM in eval mode, built from ``causal_lm_config`` (same
    arguments, ``arch`` "qwen3", "llama", "qwen3_5", "qwen3_next" or "qwen3_moe"; ``overrides`` go to the
    config).

    The weights are drawn in fp32 right after ``torch.manual_seed(seed)``, so ``seed`` makes them
    reproducible; ``dtype`` (a torch dtype) then casts them and is recorded in the config (what
    ``save_pretrained`` writes), fp32 is kept otherwise. When a tokenizer is given, its eos (and
    pad) ids are also set in the generation config.
    """
    import torch

    if dtype is not None:
        overrides = {"dtype": dtype, **overrides}
    config, cls, ids = _config_and_ids(tokenizer_or_vocab_size, arch, num_layers, hidden, num_heads, num_kv_heads,
                                       intermediate, max_position_embeddings, head_dim, overrides)
    torch.manual_seed(seed)
    model = cls(config).float().eval()
    if dtype is not None:
        model.to(dtype)
    if "eos_token_id" in ids:
        model.generation_config.eos_token_id = ids["eos_token_id"]
        model.generation_config.pad_token_id = ids.get("pad_token_id", ids["eos_token_id"])
    return model


class ToyOpenAIServer:
    """An OpenAI-compatible HTTP server on 127.0.0.1 serving a Hugging Face model, in a thread.

    Endpoints: ``POST /v1/chat/completions`` (messages rendered with the tokenizer's chat
    template; ``chat_template_kwargs`` passed through, as vLLM / SGLang do) and
    ``POST /v1/completions`` (raw prompt), plus ``GET /v1/models``. Greedy when temperature is 0.
    Requests are handled concurrently; model calls are serialised by a lock.

    Error injection for retry tests: the first ``fail_first`` requests, and then every
    ``fail_every``-th request (0: never), get HTTP ``fail_status``; ``delay_s`` sleeps before
    answering. Counters: ``num_requests``, ``num_failed``. Use as a context manager;
    ``url`` is the base URL (``http://127.0.0.1:PORT/v1``).
    """

    def __init__(self, model, tokenizer, *, model_name: str = "toy", fail_first: int = 0, fail_every: int = 0,
                 fail_status: int = 500, delay_s: float = 0.0):
        self.model, self.tokenizer, self.model_name = model, tokenizer, model_name
        self.fail_first, self.fail_every, self.fail_status, self.delay_s = fail_first, fail_every, fail_status, delay_s
        self.num_requests = 0
        self.num_failed = 0
        self._count_lock = threading.Lock()
        self._model_lock = threading.Lock()
        server = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args):  # keep test output clean
                pass

            def _send(self, status: int, payload: dict):
                body = json.dumps(payload).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def do_GET(self):
                if self.path.rstrip("/") == "/v1/models":
                    self._send(200, {"object": "list", "data": [{"id": server.model_name, "object": "model"}]})
                else:
                    self._send(404, {"error": {"message": f"no route {self.path}"}})

            def do_POST(self):
                length = int(self.headers.get("Content-Length") or 0)
                raw = self.rfile.read(length)
                if server._should_fail():
                    self._send(server.fail_status, {"error": {"message": "injected failure"}})
                    return
                if server.delay_s:
                    time.sleep(server.delay_s)
                try:
                    request = json.loads(raw)
                    if self.path.rstrip("/") == "/v1/chat/completions":
                        self._send(200, server._chat(request))
                    elif self.path.rstrip("/") == "/v1/completions":
                        self._send(200, server._complete(request))
                    else:
                        self._send(404, {"error": {"message": f"no route {self.path}"}})
                except (ValueError, KeyError, TypeError) as exc:
                    self._send(400, {"error": {"message": f"bad request: {exc}"}})

        self._httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._httpd.daemon_threads = True
        self._thread = threading.Thread(target=self._httpd.serve_forever, name="toy-openai-server", daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self._httpd.server_address[1]}/v1"

    def _should_fail(self) -> bool:
        with self._count_lock:
            self.num_requests += 1
            n = self.num_requests
            fail = n <= self.fail_first or (self.fail_every > 0 and n % self.fail_every == 0)
            self.num_failed += int(fail)
            return fail

    def _generate(self, prompt_ids: list[int], request: dict) -> tuple[str, int, str]:
        import torch

        temperature = float(request.get("temperature", 1.0) or 0.0)
        max_tokens = int(request.get("max_tokens") or request.get("max_completion_tokens") or 64)
        kwargs = {"do_sample": temperature > 0, "max_new_tokens": max_tokens,
                  "pad_token_id": self.tokenizer.pad_token_id}
        if temperature > 0:
            kwargs.update(temperature=temperature, top_p=float(request.get("top_p", 1.0)))
        with self._model_lock, torch.no_grad():
            if temperature > 0 and request.get("seed") is not None:
                torch.manual_seed(int(request["seed"]))
            ids = torch.tensor([prompt_ids])
            out = self.model.generate(ids, attention_mask=torch.ones_like(ids), **kwargs)[0, len(prompt_ids):].tolist()
        eos = set(_as_list(self.model.generation_config.eos_token_id))
        finish = "length"
        for i, t in enumerate(out):
            if t in eos:
                out, finish = out[:i], "stop"
                break
        return self.tokenizer.decode(out, skip_special_tokens=True), len(out), finish

    def _chat(self, request: dict) -> dict:
        messages = request["messages"]
        kwargs = dict(request.get("chat_template_kwargs") or {})
        prompt_ids = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                                         return_dict=False, **kwargs)
        text, n, finish = self._generate(list(prompt_ids), request)
        return {"id": f"chatcmpl-{self.num_requests}", "object": "chat.completion", "model": self.model_name,
                "choices": [{"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": finish}],
                "usage": {"prompt_tokens": len(prompt_ids), "completion_tokens": n}}

    def _complete(self, request: dict) -> dict:
        prompt_ids = self.tokenizer(request["prompt"], add_special_tokens=False)["input_ids"]
        text, n, finish = self._generate(prompt_ids, request)
        return {"id": f"cmpl-{self.num_requests}", "object": "text_completion", "model": self.model_name,
                "choices": [{"index": 0, "text": text, "finish_reason": finish}],
                "usage": {"prompt_tokens": len(prompt_ids), "completion_tokens": n}}

    def start(self) -> ToyOpenAIServer:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._httpd.shutdown()
        self._httpd.server_close()

    def __enter__(self) -> ToyOpenAIServer:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


def _as_list(x) -> list:
    if x is None:
        return []
    return list(x) if isinstance(x, list | tuple) else [x]


_TOPICS = ["the weather", "prime numbers", "a sorting algorithm", "French cooking", "the moon", "tax forms",
           "a poem about rivers", "unit tests", "graph theory", "bicycles"]
_WORDS = ("alpha beta gamma delta token model answer question reason step first then finally because "
          "therefore example value result number list table point line code data").split()


def synthetic_conversations(n: int, seed: int = 0, *, max_turns: int = 3, think_share: float = 0.3,
                            shape: str = "openai"):
    """``n`` deterministic pseudo-random chat records (dicts) for tests and benchmarks.

    Multi-turn (1..max_turns user/assistant pairs), some with a system prompt and some with
    ``<think>`` reasoning in the last reply. ``shape``: "openai" (messages/role/content) or
    "sharegpt" (conversations/from/value). Each record has an ``id``.
    """
    import random

    rng = random.Random(seed)
    out = []
    for i in range(n):
        msgs = []
        if rng.random() < 0.3:
            msgs.append({"role": "system", "content": "You are a concise assistant."})
        turns = rng.randint(1, max_turns)
        for t in range(turns):
            topic = rng.choice(_TOPICS)
            msgs.append({"role": "user", "content": f"Question {i}.{t}: tell me about {topic}?"})
            reply = " ".join(rng.choice(_WORDS) for _ in range(rng.randint(20, 120))) + "."
            if t == turns - 1 and rng.random() < think_share:
                thought = " ".join(rng.choice(_WORDS) for _ in range(rng.randint(5, 30)))
                reply = f"<think>\n{thought}\n</think>\n\n{reply}"
            msgs.append({"role": "assistant", "content": reply})
        if shape == "sharegpt":
            names = {"system": "system", "user": "human", "assistant": "gpt"}
            out.append({"id": f"s{i}",
                        "conversations": [{"from": names[m["role"]], "value": m["content"]} for m in msgs]})
        else:
            out.append({"id": f"s{i}", "messages": msgs})
    return out
