"""Log-probabilities in OpenAI's response shapes, from the (id, (log-prob, top)) pairs the batcher hands out.

Chat: ``{"content": [{"token", "logprob", "bytes", "top_logprobs": [...]}], "refusal": null}``. Completions
(the legacy shape): ``{"tokens", "token_logprobs", "top_logprobs": [{token: log-prob}], "text_offset"}``,
offsets counted in characters from the start of the completion's text. A token's text is the tokenizer's
decoding of that id alone. Values are log_softmax of the model's logits (before temperature and top_p).
"""

from __future__ import annotations

Entry = tuple[int, tuple[float, list[tuple[int, float]]]]  # id, (its log-prob, the k most likely)


class LogprobFormat:
    def __init__(self, tokenizer) -> None:
        self.tok = tokenizer
        self._text: dict[int, str] = {}
        self.offset = 0  # characters of the completion's text before the next token (text_offset)

    def text(self, token: int) -> str:
        if token not in self._text:
            self._text[token] = self.tok.decode([token], skip_special_tokens=False)
        return self._text[token]

    def _one(self, token: int, logprob: float) -> dict:
        s = self.text(token)
        return {"token": s, "logprob": logprob, "bytes": list(s.encode("utf-8"))}

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
