"""loss_mask covers exactly each assistant reply + its end-of-turn token, with real templates.

Masked spans are decoded and compared with the expected strings, for Qwen3-style ChatML
(thinking and non-thinking mode, <think> supervised or not), Llama 3 and a template with
{% generation %} markers (where the tokenizer's own assistant mask must agree with ours).
"""

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from conftest import supervised_runs
from flashdraft.data.chat import SampleError, normalize_record
from flashdraft.data.masking import probe_template, render, tokenize_conversation
from flashdraft.toy import train_toy_tokenizer

TOK = {style: train_toy_tokenizer(template=style) for style in ("qwen3", "llama3", "generation")}
EOT = {"qwen3": "<|im_end|>", "llama3": "<|eot_id|>", "generation": "<|end|>"}

CHAT = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Hi"},
    {"role": "assistant", "content": "Hello there!"},
    {"role": "user", "content": "What is 2+2?"},
    {"role": "assistant", "content": "<think>\nadd them\n</think>\n\nIt is 4."},
]
PLAIN = CHAT[:4] + [{"role": "assistant", "content": "It is 4."}]


def spans(style, messages, **kw):
    tok = TOK[style]
    ids, mask = tokenize_conversation(tok, messages, **kw)
    assert ids.shape == mask.shape and mask.dtype == np.uint8
    # Nothing is lost: the tokens are exactly the chat template's rendering.
    thinking = kw.get("enable_thinking")
    rendered = render(tok, messages, template_kwargs=() if thinking is None else (("enable_thinking", thinking),))
    if kw.get("max_length") is None:
        assert tok.decode(ids.tolist()) == rendered
    return supervised_runs(tok, ids, mask)


def test_qwen3_multi_turn_with_thinking_supervised():
    assert spans("qwen3", CHAT) == ["Hello there!<|im_end|>", "<think>\nadd them\n</think>\n\nIt is 4.<|im_end|>"]


def test_qwen3_thinking_unsupervised():
    assert spans("qwen3", CHAT, supervise_thinking=False) == ["Hello there!<|im_end|>", "It is 4.<|im_end|>"]


def test_qwen3_non_thinking_mode_keeps_the_empty_think_block_in_the_prompt():
    # Served with enable_thinking=False, the generation prompt already ends with an empty think
    # block: the target never generates it, so it is not supervised.
    assert spans("qwen3", PLAIN, enable_thinking=False) == ["Hello there!<|im_end|>", "It is 4.<|im_end|>"]
    ids, _ = tokenize_conversation(TOK["qwen3"], PLAIN, enable_thinking=False)
    assert "<think>\n\n</think>" in TOK["qwen3"].decode(ids.tolist())


def test_qwen3_thinking_mode_supervises_the_generated_think_block():
    # In thinking mode the target itself writes <think>...</think>, even when empty.
    assert spans("qwen3", PLAIN, enable_thinking=True) == [
        "Hello there!<|im_end|>", "<think>\n\n</think>\n\nIt is 4.<|im_end|>"]


def test_qwen3_reasoning_in_data_served_without_thinking_is_rejected():
    with pytest.raises(SampleError) as err:
        tokenize_conversation(TOK["qwen3"], CHAT, enable_thinking=False)
    assert err.value.reason == "thinking_mismatch"


@pytest.mark.parametrize("earlier", [{"content": "<think>\ngreet\n</think>\n\nHello there!"},
                                     {"content": "Hello there!", "reasoning_content": "greet"}])
def test_qwen3_non_thinking_keeps_a_chat_whose_only_reasoning_is_in_an_earlier_reply(earlier):
    # Qwen3's template renders no reasoning for replies before the last user turn: the rendered
    # sample holds none, so it is valid in non-thinking mode; the final reply's reasoning still decides.
    chat = CHAT[:2] + [{"role": "assistant", **earlier}] + PLAIN[3:]
    assert spans("qwen3", chat, enable_thinking=False) == ["Hello there!<|im_end|>", "It is 4.<|im_end|>"]
    with pytest.raises(SampleError) as err:
        tokenize_conversation(TOK["qwen3"], chat[:4] + CHAT[4:], enable_thinking=False)
    assert err.value.reason == "thinking_mismatch"


def test_llama3_multi_turn_with_default_system_header_and_trimmed_content():
    chat = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "  Hello there!\n"},
            {"role": "user", "content": "More?"}, {"role": "assistant", "content": "Sure: more."}]
    assert spans("llama3", chat) == ["Hello there!<|eot_id|>", "Sure: more.<|eot_id|>"]
    assert spans("llama3", CHAT, supervise_thinking=False) == ["Hello there!<|eot_id|>", "It is 4.<|eot_id|>"]


def test_generation_markers_agree_with_rendered_prefix_mask():
    tok = TOK["generation"]
    assert probe_template(tok).has_generation_markers
    out = tok.apply_chat_template(CHAT, return_dict=True, return_assistant_tokens_mask=True)
    ids, mask = tokenize_conversation(tok, CHAT, verify_markers=True)
    assert out["input_ids"] == ids.tolist() and out["assistant_masks"] == mask.tolist()
    assert supervised_runs(tok, ids, mask) == ["Hello there!<|end|>", "<think>\nadd them\n</think>\n\nIt is 4.<|end|>"]
    assert spans("generation", CHAT, supervise_thinking=False) == ["Hello there!<|end|>", "It is 4.<|end|>"]


@pytest.mark.parametrize("style", ["qwen3", "llama3", "generation"])
def test_single_turn_and_templated_text_give_the_same_mask(style):
    tok = TOK[style]
    chat = [{"role": "user", "content": "Name a colour."}, {"role": "assistant", "content": "Blue."}]
    # Qwen3's template (thinking mode by default) renders the final reply with the think block
    # the target writes, even when empty.
    think = "<think>\n\n</think>\n\n" if style == "qwen3" else ""
    assert spans(style, chat) == [f"{think}Blue.{EOT[style]}"]
    for messages in (chat, PLAIN):
        a = tokenize_conversation(tok, messages)
        b = tokenize_conversation(tok, text=render(tok, messages))
        assert np.array_equal(a[0], b[0]) and np.array_equal(a[1], b[1])


def test_truncation_keeps_the_prefix():
    ids, mask = tokenize_conversation(TOK["qwen3"], CHAT)
    short_ids, short_mask = tokenize_conversation(TOK["qwen3"], CHAT, max_length=20)
    assert np.array_equal(short_ids, ids[:20]) and np.array_equal(short_mask, mask[:20])


def test_sharegpt_and_openai_shapes_normalise_alike():
    openai = {"messages": [{"role": "user", "content": [{"type": "text", "text": "Hi"}]},
                           {"role": "assistant", "content": "Yo"}]}
    sharegpt = {"conversations": [{"from": "human", "value": "Hi"}, {"from": "gpt", "value": "Yo"}]}
    assert normalize_record(openai) == normalize_record(sharegpt)


@pytest.mark.parametrize("record,reason", [
    ({"messages": [{"role": "robot", "content": "x"}, {"role": "assistant", "content": "y"}]}, "unknown_role"),
    ({"messages": [{"role": "user", "content": "x"}, {"role": "assistant", "content": " "}]}, "empty_assistant"),
    ({"messages": [{"role": "user", "content": "x"}, {"role": "assistant", "content": "y"},
                   {"role": "user", "content": "z"}]}, "ends_with_user"),
    ({"messages": [{"role": "user", "content": "x"}]}, "no_assistant"),
    ({"prompt": "x"}, "bad_shape"),
    ([1, 2], "bad_shape"),
])
def test_bad_records_raise_a_sample_error_with_a_reason(record, reason):
    with pytest.raises(SampleError) as err:
        normalize_record(record, "f.jsonl:3")
    assert err.value.reason == reason and "f.jsonl:3" in str(err.value)


# Property: for any multi-turn chat, the supervised spans are exactly the replies + end-of-turn.
_text = st.text(alphabet=st.characters(codec="utf-8", exclude_characters="<>|\r\x0b\x0c\x1c\x1d\x1e\x85\u2028\u2029",
                                       exclude_categories=("Cs", "Cc")), min_size=1, max_size=30)
_reply = _text.map(str.strip).filter(bool)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(style=st.sampled_from(["qwen3", "llama3", "generation"]), system=st.booleans(),
       turns=st.lists(st.tuples(_reply, _reply), min_size=1, max_size=3))
def test_mask_property_replies_plus_end_of_turn(style, system, turns):
    messages = [{"role": "system", "content": "Sys."}] if system else []
    for user, reply in turns:
        messages += [{"role": "user", "content": user}, {"role": "assistant", "content": reply}]
    got = spans(style, messages)
    expected = [reply + EOT[style] for _, reply in turns]
    if style == "qwen3":
        expected[-1] = "<think>\n\n</think>\n\n" + expected[-1]
    # Adjacent replies never merge (a user turn separates them), so runs map 1:1 to replies.
    assert got == expected
