"""Tokenizers shared by a hierarchy, with a fingerprint to check that all stages agree."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from typing import Protocol


class Tokenizer(Protocol):
    eos_token_id: int
    vocab_size: int

    def encode(self, text: str, chat: bool) -> list[int]: ...

    def encode_chat(self, turns: Sequence[tuple[str, str]]) -> list[int]:
        """Chat turns ((role, content), ...) through the chat template, ready for the reply."""

    def decode(self, ids: Sequence[int]) -> str: ...

    def fingerprint(self) -> str:
        """A digest of the vocabulary and special tokens; equal digests = same token ids."""


class ByteTokenizer:
    """UTF-8 bytes as ids 0..255, then BOS=256, EOS=257, PAD=258 (used by the tiny hierarchy)."""

    BOS, EOS, PAD = 256, 257, 258
    vocab_size = 259

    def __init__(self, eos_token_id: int | None = None) -> None:
        self.eos_token_id = self.EOS if eos_token_id is None else int(eos_token_id)

    def encode(self, text: str, chat: bool = False) -> list[int]:
        return [self.BOS, *text.encode("utf-8")]

    def encode_chat(self, turns: Sequence[tuple[str, str]]) -> list[int]:
        """A plain rendering (there is no template for bytes): one ``role: content`` line per
        turn, then ``assistant:``."""
        return self.encode("".join(f"{role}: {content}\n" for role, content in turns) + "assistant:")

    def decode(self, ids: Sequence[int]) -> str:
        return bytes(i for i in ids if 0 <= i < 256).decode("utf-8", errors="replace")

    def fingerprint(self) -> str:
        return f"bytes-259-eos{self.eos_token_id}"


class HFTokenizer:
    """A transformers tokenizer; ``chat`` applies the model's chat template to a user turn."""

    def __init__(self, tok, eos_token_id: int | None = None) -> None:
        self.tok = tok
        self.eos_token_id = int(tok.eos_token_id if eos_token_id is None else eos_token_id)
        self.vocab_size = len(tok)

    def encode(self, text: str, chat: bool = False) -> list[int]:
        if chat:
            return self.encode_chat([("user", text)])
        return [int(i) for i in self.tok(text, add_special_tokens=True)["input_ids"]]

    def encode_chat(self, turns: Sequence[tuple[str, str]]) -> list[int]:
        if not self.tok.chat_template:
            raise ValueError("chat turns need a chat template, and the tokenizer has none")
        ids = self.tok.apply_chat_template(
            [{"role": r, "content": c} for r, c in turns], add_generation_prompt=True, tokenize=True
        )
        if hasattr(ids, "keys"):  # BatchEncoding in newer transformers
            ids = ids["input_ids"]
        return [int(i) for i in ids]

    def decode(self, ids: Sequence[int]) -> str:
        return self.tok.decode(list(ids), skip_special_tokens=True)

    def fingerprint(self) -> str:
        vocab = sorted(self.tok.get_vocab().items(), key=lambda kv: kv[1])
        special = {k: str(v) for k, v in self.tok.special_tokens_map.items()}
        blob = json.dumps([vocab, special, self.eos_token_id], sort_keys=True).encode()
        return hashlib.sha256(blob).hexdigest()[:16]
