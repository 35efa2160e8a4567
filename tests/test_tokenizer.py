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


@pytest.mark.parametrize("answer", ["The answer is", "Sure!  ", " 4, because"])
def test_continue_final_message_matches_transformers(smollm, hf_tokenizer, answer):
    """A prefilled answer: the text stops inside the last message (no end of turn after it),
    as transformers cuts it, trailing whitespace included where the template keeps it."""
    m = [{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": answer}]
    ours = smollm.tokenizer.apply_chat_template(
        m, add_generation_prompt=False, continue_final_message=True
    )
    theirs = hf_tokenizer.apply_chat_template(
        m, tokenize=False, add_generation_prompt=False, continue_final_message=True
    )
    assert ours == theirs and ours.rstrip().endswith(answer.strip())
    whole = smollm.tokenizer.apply_chat_template(m, add_generation_prompt=False)
    assert whole.startswith(ours) and len(whole) > len(ours)  # the turn's end is cut


def test_continue_final_message_refuses_what_it_cannot_continue(smollm):
    tok = smollm.tokenizer
    m = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "   "}]
    with pytest.raises(ValueError, match="no text to continue"):
        tok.apply_chat_template(m, add_generation_prompt=False, continue_final_message=True)
    with pytest.raises(ValueError, match="exclude each other"):
        tok.apply_chat_template(m[:1], add_generation_prompt=True, continue_final_message=True)


def test_template_variables_reach_the_template(smollm):
    """A model's switch (Qwen3's enable_thinking) as a template variable; the renderer's own
    variables cannot be overridden."""
    from paxengine.tokenizer import Tokenizer

    template = (
        "{% for m in messages %}<{{ m.role }}>{{ m.content }}\n{% endfor %}"
        "{% if add_generation_prompt %}<assistant>"
        "{% if enable_thinking is defined and not enable_thinking %}<think></think>{% endif %}"
        "{% endif %}"
    )
    tok = Tokenizer(smollm.tokenizer.tok, bos_token=None, eos_token=None, chat_template=template)
    m = [{"role": "user", "content": "hi"}]
    assert tok.apply_chat_template(m) == "<user>hi\n<assistant>"
    assert tok.apply_chat_template(m, enable_thinking=False).endswith("<think></think>")
    with pytest.raises(ValueError, match="bos_token"):
        tok.apply_chat_template(m, bos_token="<s>")
