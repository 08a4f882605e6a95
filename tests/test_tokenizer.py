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


# ---------------------------------------------------------------- the converted-tokenizer cache

def _same_tokenizer(a: Tokenizer, b: Tokenizer) -> None:
    assert a._tok.get_vocab() == b._tok.get_vocab()
    assert (a.vocab_size, a.bos_token_id, a.eos_token_ids) == (b.vocab_size, b.bos_token_id, b.eos_token_ids)
    assert a.special_tokens() == b.special_tokens() and a.chat_template == b.chat_template
    assert a._tok.added_tokens_decoder == b._tok.added_tokens_decoder
    for text in [*TEXTS, "<|im_start|>user\nhi<|im_end|>", "<|endoftext|> x"]:
        for special in (True, False):
            ids = a.encode(text, add_special_tokens=special)
            assert ids == b.encode(text, add_special_tokens=special), text
            assert a.decode(ids) == b.decode(ids)
            assert a.decode(ids, skip_special_tokens=False) == b.decode(ids, skip_special_tokens=False)
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": TEXTS[2]}]
    assert a.render_chat(msgs) == b.render_chat(msgs)


def test_cache_stores_then_serves_the_same_tokenizer(tmp_path, monkeypatch):
    import entropic.model.tokenizer as tk

    monkeypatch.setenv("ENTROPIC_TOKENIZERS_DIR", str(tmp_path))
    fresh = Tokenizer.from_gguf(default_model_path())  # converted, and stored
    folders = [p for p in tmp_path.iterdir()]
    assert len(folders) == 1 and (folders[0] / "tokenizer.json").is_file()

    def no_conversion(path):
        raise AssertionError("converted again despite the cache")

    monkeypatch.setattr(tk, "_convert_gguf_tokenizer", no_conversion)
    cached = Tokenizer.from_gguf(default_model_path())
    _same_tokenizer(fresh, cached)
    assert list(tmp_path.iterdir()) == folders  # nothing more written


def test_cache_keyed_by_the_file(tmp_path, monkeypatch):
    from test_loader import write_tiny_gguf

    monkeypatch.setenv("ENTROPIC_TOKENIZERS_DIR", str(tmp_path / "cache"))
    write_tiny_gguf(tmp_path / "tiny.gguf", tokenizer=True)
    tiny = Tokenizer.from_gguf(tmp_path / "tiny.gguf")
    big = Tokenizer.from_gguf(default_model_path())
    assert len(list((tmp_path / "cache").iterdir())) == 2
    assert tiny.vocab_size == 260 and big.vocab_size == 49152
    assert Tokenizer.from_gguf(tmp_path / "tiny.gguf").encode("he") == tiny.encode("he")


def test_cache_off_damaged_or_unwritable(tmp_path, monkeypatch, tok, caplog):
    monkeypatch.setenv("ENTROPIC_TOKENIZERS_DIR", "none")
    _same_tokenizer(Tokenizer.from_gguf(default_model_path()), tok)
    assert not any(tmp_path.iterdir())

    # a damaged folder: converted again, and replaced by a good one
    monkeypatch.setenv("ENTROPIC_TOKENIZERS_DIR", str(tmp_path))
    Tokenizer.from_gguf(default_model_path())
    (folder,) = tmp_path.iterdir()
    (folder / "tokenizer.json").write_text("{not json")
    _same_tokenizer(Tokenizer.from_gguf(default_model_path()), tok)
    assert "unreadable" in caplog.text
    _same_tokenizer(Tokenizer.from_gguf(default_model_path()), tok)  # the replacement reads

    # a cache path that cannot be a folder: the tokenizer still loads, with a warning
    blocker = tmp_path / "a_file"
    blocker.write_text("")
    monkeypatch.setenv("ENTROPIC_TOKENIZERS_DIR", str(blocker / "sub"))
    caplog.clear()
    _same_tokenizer(Tokenizer.from_gguf(default_model_path()), tok)
    assert "cannot cache the tokenizer" in caplog.text
