"""Tokenizer: a thin wrapper over a Hugging Face fast tokenizer, offline only.

transformers is imported lazily: it costs ~2 s and importing the loader should be cheap.
"""
from __future__ import annotations

import hashlib
import logging
import os
import shutil
import tempfile
from collections.abc import Mapping, Sequence
from pathlib import Path

LONG_TEXT = 1 << 16  # characters from which encode calls the Rust tokenizer directly
# Bumped when what a cached tokenizer folder holds, or how it is made, changes.
_CACHE_FORMAT = 1

log = logging.getLogger(__name__)


def tokenizer_cache_dir() -> Path | None:
    """Where converted GGUF tokenizers are kept: $ENTROPIC_TOKENIZERS_DIR, else
    ~/.cache/entropic/tokenizers; None when that variable is "none" (no cache)."""
    root = os.environ.get("ENTROPIC_TOKENIZERS_DIR")
    if root is not None and root.strip().lower() == "none":
        return None
    return Path(root) if root else Path.home() / ".cache" / "entropic" / "tokenizers"


def _gguf_header_key(path: str, tensors: Mapping) -> str:
    """A digest of everything before the tensor data (the metadata: vocabulary, merges,
    special tokens, chat template), the library versions and the cache format."""
    import tokenizers
    import transformers

    end = min((t.offset for t in tensors.values()), default=os.path.getsize(path))
    h = hashlib.sha256(f"{_CACHE_FORMAT} {transformers.__version__} "
                       f"{tokenizers.__version__}\n".encode())
    with open(path, "rb") as f:
        h.update(f.read(end))
    return h.hexdigest()[:24]


def _convert_gguf_tokenizer(path: str):
    from transformers import PreTrainedTokenizerFast

    # The fast class directly, not AutoTokenizer: AutoTokenizer first builds a model config
    # through gguf.GGUFReader, which takes ~3 s on a 49k vocabulary; the result is the same.
    try:
        return PreTrainedTokenizerFast.from_pretrained(
            os.path.dirname(path), gguf_file=os.path.basename(path), local_files_only=True
        )
    except Exception as e:  # transformers raises many types for an unsupported vocab
        raise ValueError(f"{path}: cannot build tokenizer from GGUF ({e})") from e


def _cached_gguf_tokenizer(path: str, tensors: Mapping):
    """transformers' tokenizer for a GGUF file, from the cache when it holds this header's.
    A cache that cannot be read or written costs the conversion, never the load."""
    from transformers import PreTrainedTokenizerFast

    root = tokenizer_cache_dir()
    if root is None:
        return _convert_gguf_tokenizer(path)
    folder = root / _gguf_header_key(path, tensors)
    if folder.is_dir():
        try:
            return PreTrainedTokenizerFast.from_pretrained(folder, local_files_only=True)
        except Exception as e:  # a folder damaged outside entropic: convert and replace it
            log.warning("tokenizer cache %s unreadable (%s); converting %s again", folder, e, path)
            shutil.rmtree(folder, ignore_errors=True)
    tok = _convert_gguf_tokenizer(path)
    try:
        root.mkdir(parents=True, exist_ok=True)
        tmp = tempfile.mkdtemp(prefix=f".{folder.name}.", dir=root)
        try:
            tok.save_pretrained(tmp)
            try:
                os.replace(tmp, folder)  # whole or not at all
            except OSError:
                if not folder.is_dir():  # else another process stored it first: fine
                    raise
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    except OSError as e:
        log.warning("cannot cache the tokenizer of %s under %s (%s)", path, root, e)
    return tok


class Tokenizer:
    """Encode/decode text and render chat prompts for one model.

    `encode` adds BOS only when the model's tokenizer is configured to (SmolLM2 is not).
    `eos_token_ids` are the ids that end generation, as the model declares them.
    """

    def __init__(self, hf_tokenizer, *, eos_token_ids: Sequence[int] = (), source: str = ""):
        self._tok = hf_tokenizer
        self.source = source
        self.vocab_size: int = len(hf_tokenizer)
        self.bos_token_id: int | None = hf_tokenizer.bos_token_id
        ids = list(eos_token_ids)
        if not ids and hf_tokenizer.eos_token_id is not None:
            ids = [hf_tokenizer.eos_token_id]
        self.eos_token_ids: tuple[int, ...] = tuple(dict.fromkeys(int(i) for i in ids))

    @classmethod
    def from_gguf(cls, path: str, eos_token_ids: Sequence[int] | None = None) -> Tokenizer:
        """Build from a GGUF file's embedded vocabulary, merges and chat template.

        transformers' conversion of a GGUF vocabulary takes ~1 s (SmolLM2's 49k tokens); its
        result is kept as a tokenizer folder under `tokenizer_cache_dir()`, keyed by the
        file's header bytes and the library versions, and later loads read that (~0.1 s).
        """
        from entropic.model.gguf_loader import read_gguf_metadata

        path = os.path.abspath(os.fspath(path))
        meta, tensors = read_gguf_metadata(path)
        if "tokenizer.ggml.model" not in meta:
            raise ValueError(f"{path}: GGUF has no tokenizer metadata (tokenizer.ggml.model)")
        tok = _cached_gguf_tokenizer(path, tensors)
        if not tok.chat_template and meta.get("tokenizer.chat_template"):
            tok.chat_template = meta["tokenizer.chat_template"]
        if eos_token_ids is None:
            eos = meta.get("tokenizer.ggml.eos_token_id")
            eos_token_ids = () if eos is None else (int(eos),)
        return cls(tok, eos_token_ids=eos_token_ids, source=path)

    @classmethod
    def from_hf_dir(cls, path: str, eos_token_ids: Sequence[int] | None = None) -> Tokenizer:
        """Build from a Hugging Face model directory (tokenizer.json / tokenizer_config.json)."""
        from transformers import AutoTokenizer

        from entropic.model.hf_loader import eos_ids_from_dir

        path = os.path.abspath(os.fspath(path))
        try:
            tok = AutoTokenizer.from_pretrained(path, local_files_only=True)
        except Exception as e:
            raise ValueError(f"{path}: cannot load a tokenizer from this directory ({e})") from e
        if eos_token_ids is None and os.path.isfile(os.path.join(path, "config.json")):
            eos_token_ids = eos_ids_from_dir(path)
        return cls(tok, eos_token_ids=eos_token_ids or (), source=path)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of `text`, with BOS only if the model's tokenizer adds one (and
        `add_special_tokens`); special-token strings in the text map to their ids either way."""
        if not isinstance(text, str):
            raise TypeError(f"encode expects str, got {type(text).__name__}")
        return self._encode(text, add_special_tokens)

    def _encode(self, text: str, add_special_tokens: bool) -> list[int]:
        backend = getattr(self._tok, "_tokenizer", None)
        fast = getattr(backend, "encode_batch_fast", None) or getattr(backend, "encode_batch", None)
        if len(text) >= LONG_TEXT and fast is not None:
            # The Rust tokenizer's batch call releases the GIL while it works; transformers'
            # encode holds it for ~0.1 s per million tokens building and then freeing its
            # extra fields (token strings, offsets), and the server tokenizes in a worker
            # thread beside the event loop and the engine. The "fast" batch call skips the
            # offsets: 3x faster, and its result is freed in milliseconds. The same ids
            # (tests/test_tokenizer.py).
            return fast([text], add_special_tokens=add_special_tokens)[0].ids
        return list(self._tok.encode(text, add_special_tokens=add_special_tokens))

    def special_tokens(self) -> dict[str, str | None]:
        """bos/eos/pad/unk token strings. EOS is the first id that ends generation, as the
        model declares it (which may differ from the HF tokenizer's own eos_token)."""
        t = self._tok
        eos = (self.convert_ids_to_tokens(self.eos_token_ids[:1])[0] if self.eos_token_ids
               else t.eos_token)
        return {"bos_token": t.bos_token, "eos_token": eos, "pad_token": t.pad_token,
                "unk_token": t.unk_token}

    @property
    def class_name(self) -> str:
        """The Hugging Face tokenizer class behind this one (vLLM's `tokenizer_class`)."""
        return type(self._tok).__name__

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        """Text of `ids`; special tokens (BOS, EOS, chat markers) are dropped by default."""
        return self._tok.decode([int(i) for i in ids], skip_special_tokens=skip_special_tokens)

    def convert_ids_to_tokens(self, ids: Sequence[int]) -> list[str]:
        """Vocabulary strings of `ids` (byte-level BPE spelling, e.g. 'Ġworld')."""
        return list(self._tok.convert_ids_to_tokens([int(i) for i in ids]))

    @property
    def chat_template(self) -> str | None:
        """The model's Jinja chat template, or None if it has none."""
        return self._tok.chat_template or None

    def render_chat(self, messages: list[dict], add_generation_prompt: bool = True) -> str:
        """The chat prompt as text. Raises ValueError on a missing template or bad messages."""
        if not self.chat_template:
            raise ValueError(f"{self.source or 'tokenizer'}: the model has no chat template "
                             "(a base model?); give it raw text prompts (generate) instead")
        _check_messages(messages)
        return self._tok.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=add_generation_prompt
        )

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True) -> list[int]:
        """Token ids of the chat prompt. The template writes any BOS itself, so none is added."""
        return self._encode(self.render_chat(messages, add_generation_prompt), False)


def _check_messages(messages) -> None:
    if not isinstance(messages, list) or not messages:
        raise ValueError("messages must be a non-empty list of {'role': str, 'content': str} dicts")
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            raise ValueError(f"messages[{i}] must be a dict, got {type(m).__name__}")
        for key in ("role", "content"):
            if not isinstance(m.get(key), str):
                raise ValueError(f"messages[{i}][{key!r}] must be a str, got {m.get(key)!r}")
