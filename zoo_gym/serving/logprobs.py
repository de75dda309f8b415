"""Log-probabilities in OpenAI's response shapes, from the (id, (log-prob, top)) pairs the batcher hands out.

Chat: ``{"content": [{"token", "logprob", "bytes", "top_logprobs": [...]}], "refusal": null}``. Completions
(the legacy shape): ``{"tokens", "token_logprobs", "top_logprobs": [{token: log-prob}], "text_offset"}``,
offsets counted in characters from the start of the completion's text. A token's text is the tokenizer's
decoding of that id alone; its ``bytes`` are the token's own raw bytes, so a token that holds part of a
multi-byte character (byte-level BPE: Qwen, Llama 3, GPT-2; SentencePiece's ``<0xNN>`` byte fallback)
gives those bytes, which the client joins with its neighbours' to recover the character, where its text is
U+FFFD. Values are log_softmax of the model's logits (before temperature and top_p).
"""

from __future__ import annotations

import re

from transformers.convert_slow_tokenizer import bytes_to_unicode

Entry = tuple[int, tuple[float, list[tuple[int, float]]]]  # id, (its log-prob, the k most likely)


class LogprobFormat:
    def __init__(self, tokenizer) -> None:
        self.tok = tokenizer
        self._text: dict[int, str] = {}
        self._bytes: dict[int, list[int]] = {}
        self._byte_level = _is_byte_level(tokenizer)
        self._added = set(getattr(tokenizer, "added_tokens_decoder", {}))
        self.offset = 0  # characters of the completion's text before the next token (text_offset)

    def text(self, token: int) -> str:
        if token not in self._text:
            self._text[token] = self.tok.decode([token], skip_special_tokens=False)
        return self._text[token]

    def raw_bytes(self, token: int) -> list[int]:
        if token not in self._bytes:
            self._bytes[token] = self._raw_bytes(token)
        return self._bytes[token]

    def _raw_bytes(self, token: int) -> list[int]:
        piece = self.tok.convert_ids_to_tokens(token)
        if token not in self._added and isinstance(piece, str):
            if self._byte_level and all(c in _UNICODE_TO_BYTE for c in piece):
                return [_UNICODE_TO_BYTE[c] for c in piece]
            if m := _BYTE_FALLBACK.fullmatch(piece):
                return [int(m.group(1), 16)]
        return list(self.text(token).encode("utf-8"))

    def _one(self, token: int, logprob: float) -> dict:
        return {"token": self.text(token), "logprob": logprob, "bytes": self.raw_bytes(token)}

    def chat(self, entries: list[Entry]) -> dict:
        return {"content": [{**self._one(t, lp), "top_logprobs": [self._one(i, v) for i, v in top]}
                            for t, (lp, top) in entries], "refusal": None}

    def completion(self, entries: list[Entry]) -> dict:
        """The legacy shape of these tokens, offsets following the tokens formatted before (streaming)."""
        out = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        for t, (lp, top) in entries:
            s = self.text(t)
            out["tokens"].append(s)
            out["token_logprobs"].append(lp)
            # OpenAI: the sampled token is listed too, so up to logprobs + 1 entries
            out["top_logprobs"].append({self.text(i): v for i, v in top} | {s: lp})
            out["text_offset"].append(self.offset)
            self.offset += len(s)
        return out


# Byte-level BPE writes each byte as one printable character (GPT-2's table); tokenizers keeps the table
# inside its Rust decoder, so the inverse comes from transformers' copy of it.
_UNICODE_TO_BYTE = {c: b for b, c in bytes_to_unicode().items()}
_BYTE_FALLBACK = re.compile(r"<0x([0-9A-Fa-f]{2})>")


def _is_byte_level(tokenizer) -> bool:
    backend = getattr(tokenizer, "backend_tokenizer", None)
    decoder = getattr(backend, "decoder", None)
    if decoder is None:
        return False
    if type(decoder).__name__ == "ByteLevel":
        return True
    # a Sequence decoder (Llama 3: ByteLevel inside) says so in its JSON form
    return '"ByteLevel"' in str(decoder.__getstate__())
