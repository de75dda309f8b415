"""A logprob entry's ``bytes`` are the token's raw bytes (OpenAI: "useful for characters represented by
multiple tokens"), so a client that joins them recovers text whose tokens split a UTF-8 character, where
each such token's ``token`` text is U+FFFD."""

from __future__ import annotations

from transformers import AutoTokenizer

from zoo_gym.gym_train import tiny_model_dir
from zoo_gym.serving.logprobs import LogprobFormat

TEXT = "héllo → 世界, naïve 🙂"


def test_joined_bytes_of_split_characters_give_the_text_back():
    tok = AutoTokenizer.from_pretrained(tiny_model_dir())
    fmt = LogprobFormat(tok)
    ids = tok.encode(TEXT, add_special_tokens=False)
    entries = fmt.chat([(i, (-1.0, [(i, -1.0)])) for i in ids])["content"]
    assert any(e["token"] == "\ufffd" for e in entries)  # the tiny vocabulary splits these characters
    assert bytes(b for e in entries for b in e["bytes"]).decode("utf-8") == TEXT
    assert [e["top_logprobs"][0]["bytes"] for e in entries] == [e["bytes"] for e in entries]


def test_special_tokens_are_their_own_text_in_utf8():
    tok = AutoTokenizer.from_pretrained(tiny_model_dir())
    fmt = LogprobFormat(tok)
    end = tok.convert_tokens_to_ids("<|im_end|>")
    assert fmt.raw_bytes(end) == list(b"<|im_end|>")


def test_sentencepiece_byte_fallback_tokens_give_their_byte():
    """Llama 2 / Gemma style: a character outside the vocabulary becomes ``<0xNN>`` tokens, one byte each."""
    from tokenizers import Tokenizer, decoders, models
    from transformers import PreTrainedTokenizerFast

    vocab = {f"<0x{b:02X}>": b for b in range(256)} | {c: 256 + i for i, c in enumerate("ehlo ")}
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[], byte_fallback=True))
    backend.decoder = decoders.Sequence([decoders.ByteFallback(), decoders.Fuse()])
    tok = PreTrainedTokenizerFast(tokenizer_object=backend)
    fmt = LogprobFormat(tok)
    ids = tok.encode("hello 世界", add_special_tokens=False)
    assert tok.convert_ids_to_tokens(ids[-1]) == "<0x8C>"
    assert bytes(b for i in ids for b in fmt.raw_bytes(i)).decode("utf-8") == "hello 世界"
