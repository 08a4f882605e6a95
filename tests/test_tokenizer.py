"""Tokenizer wrapper on the bundled SmolLM2 GGUF, checked against transformers' AutoTokenizer."""
from __future__ import annotations

import os

import pytest

from entropic.model.loader import default_model_path
from entropic.model.tokenizer import Tokenizer

pytestmark = pytest.mark.model  # every test here uses the bundled SmolLM2 tokenizer

TEXTS = [
    "Hello world",
    "  leading and   inner spaces\n\nand newlines\t",
    "ünïcödé, 日本語, emoji 🎉",
    "def f(x):\n    return x ** 2  # 123456789",
    "",
]


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    return Tokenizer.from_gguf(default_model_path())


@pytest.fixture(scope="module")
def reference():
    from transformers import AutoTokenizer

    path = default_model_path()
    return AutoTokenizer.from_pretrained(
        os.path.dirname(path), gguf_file=os.path.basename(path), local_files_only=True
    )


def test_facts(tok):
    assert tok.vocab_size == 49152
    assert tok.bos_token_id == 1 and tok.eos_token_ids == (2,)
    assert tok.chat_template and "<|im_start|>" in tok.chat_template


@pytest.mark.parametrize("text", TEXTS)
def test_round_trip(tok, text):
    ids = tok.encode(text)
    assert all(isinstance(i, int) for i in ids)
    assert tok.decode(ids) == text


@pytest.mark.parametrize("text", TEXTS + ["<|im_start|>user\nHi<|im_end|>"])
def test_matches_transformers(tok, reference, text):
    assert tok.encode(text) == reference.encode(text)


@pytest.mark.parametrize("special", [True, False])
def test_long_texts_match_transformers(tok, reference, special, monkeypatch):
    """From LONG_TEXT characters on, encode calls the Rust tokenizer's batch call directly
    (it releases the GIL): the same ids as transformers' encode, special-token strings included."""
    import entropic.model.tokenizer as module

    text = "".join(TEXTS[:4] + ["<|im_start|>user\nHi<|im_end|>"]) * 40
    want = reference.encode(text, add_special_tokens=special)
    monkeypatch.setattr(module, "LONG_TEXT", 1)
    called = []
    backend = tok._tok._tokenizer
    monkeypatch.setattr(tok._tok, "_tokenizer", _Spy(backend, called))
    assert tok.encode(text, add_special_tokens=special) == want and called
    assert tok.encode("", add_special_tokens=special) == reference.encode(
        "", add_special_tokens=special)


class _Spy:
    def __init__(self, inner, called: list) -> None:
        self._inner, self._called = inner, called

    def encode_batch(self, *a, **k):
        self._called.append(1)
        return self._inner.encode_batch(*a, **k)

    def encode_batch_fast(self, *a, **k):
        self._called.append(1)
        return self._inner.encode_batch_fast(*a, **k)

    def __getattr__(self, name):
        return getattr(self._inner, name)


def test_no_bos_added(tok):
    ids = tok.encode("Hello")  # SmolLM2's GGUF says add_bos_token = false
    assert ids == [19556] and tok.bos_token_id not in ids


def test_decode_skips_special_tokens(tok):
    ids = tok.encode("<|im_start|>user\nHi<|im_end|>")
    assert ids[0] == 1 and ids[-1] == 2
    assert tok.decode(ids) == "user\nHi"
    assert tok.decode(ids, skip_special_tokens=False) == "<|im_start|>user\nHi<|im_end|>"


def test_convert_ids_to_tokens(tok):
    assert tok.convert_ids_to_tokens(tok.encode("Hello world")) == ["Hello", "Ġworld"]
    assert tok.convert_ids_to_tokens([2]) == ["<|im_end|>"]


def test_chat_template(tok, reference):
    messages = [{"role": "user", "content": "Hi"}]
    ids = tok.apply_chat_template(messages)
    text = tok.decode(ids, skip_special_tokens=False)
    assert "<|im_start|>user\nHi<|im_end|>" in text
    assert text.endswith("<|im_start|>assistant\n")
    assert text.startswith("<|im_start|>system\n")  # SmolLM2's template adds a default system turn
    expected = reference.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert ids == reference.encode(expected, add_special_tokens=False)
    without = tok.decode(tok.apply_chat_template(messages, add_generation_prompt=False), False)
    assert not without.endswith("assistant\n")


@pytest.mark.parametrize("messages", [
    [],
    "Hi",
    [{"role": "user"}],
    [{"role": "user", "content": None}],
    [{"role": 1, "content": "Hi"}],
    ["Hi"],
])
def test_chat_template_rejects_malformed(tok, messages):
    with pytest.raises(ValueError, match="messages"):
        tok.apply_chat_template(messages)


def test_no_chat_template_is_a_clear_error(tok):
    from transformers import PreTrainedTokenizerFast

    path = default_model_path()
    hf = PreTrainedTokenizerFast.from_pretrained(
        os.path.dirname(path), gguf_file=os.path.basename(path), local_files_only=True
    )
    hf.chat_template = None
    bare = Tokenizer(hf, eos_token_ids=(2,), source="bare")
    with pytest.raises(ValueError, match="no chat template"):
        bare.apply_chat_template([{"role": "user", "content": "Hi"}])
    assert bare.encode("Hello") == tok.encode("Hello")
