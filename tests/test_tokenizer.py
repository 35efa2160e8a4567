"""Tokenizer parity with transformers, chat template, incremental detokenization."""

import pytest

TEXTS = [
    "Hello world",
    "  leading spaces and\ttabs\nnewlines",
    "Numbers 1234567 and 3.14159",
    "Accents: crème brûlée, naïve café, Ærøskøbing",
    "CJK: 你好，世界。日本語のテキスト",
    "Emoji: 🙂👍🏽🇫🇷 family 👨‍👩‍👧",
    "<|im_start|>user\nhi<|im_end|>",
]


def test_encode_matches_hf(smollm, hf_tokenizer):
    hf_tok = hf_tokenizer
    for t in TEXTS:
        assert smollm.tokenizer.encode(t) == hf_tok(t)["input_ids"], t
        ids = smollm.tokenizer.encode(t)
        assert smollm.tokenizer.decode(ids, skip_special_tokens=False) == hf_tok.decode(ids)


def test_chat_template_matches_transformers(smollm, hf_tokenizer):
    hf_tok = hf_tokenizer
    msgs = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hi there"},
        {"role": "assistant", "content": "Hello!"},
        {"role": "user", "content": "2+2?"},
    ]
    for m in (msgs, msgs[1:2]):
        ours = smollm.tokenizer.apply_chat_template(m, add_generation_prompt=True)
        theirs = hf_tok.apply_chat_template(m, tokenize=False, add_generation_prompt=True)
        assert ours == theirs


@pytest.mark.parametrize("text", TEXTS[3:])
def test_incremental_detokenization_multibyte(smollm, text):
    from paxengine.tokenizer import IncrementalDetokenizer

    tok = smollm.tokenizer
    prompt = tok.encode("Say:")
    ids = tok.encode(text)
    d = IncrementalDetokenizer(tok, prompt)
    deltas = [d.add(i) for i in ids]
    deltas.append(d.flush())
    assert "".join(deltas) == tok.decode(ids)
    assert all("\ufffd" not in x for x in deltas)  # never a half character on the wire
