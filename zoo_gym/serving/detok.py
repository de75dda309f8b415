"""Incremental detokenisation for streaming: the text each new token adds, in time linear in the tokens.

Prefix offsets as in vLLM/TGI: only the ids since the last emitted boundary are decoded again (a window of
a few tokens), and text is held back while its last character is incomplete (U+FFFD) or could be the
start of a stop string. The pieces joined equal ``tokenizer.decode(ids, skip_special_tokens=True)`` cut
at the first stop string.
"""

from __future__ import annotations


class Detok:
    def __init__(self, tokenizer, stop: list[str]) -> None:
        self.tok, self.stop = tokenizer, [s for s in stop if s]
        self.hold = max((len(s) - 1 for s in self.stop), default=0)
        self.ids: list[int] = []
        self.prefix = self.read = 0  # ids[prefix:read] were decoded into text already; ids[read:] are pending
        self.text = ""  # all the text decoded so far
        self.sent = 0  # how much of it was handed out
        self.stopped = False

    def _decode(self, ids: list[int]) -> str:
        return self.tok.decode(ids, skip_special_tokens=True)

    def _new_text(self, final: bool = False) -> str:
        before = self._decode(self.ids[self.prefix:self.read])
        after = self._decode(self.ids[self.prefix:])
        if len(after) > len(before) and (final or not after.endswith("\ufffd")):
            self.prefix, self.read = self.read, len(self.ids)
            return after[len(before):]
        return ""

    def _advance(self, new: str, final: bool) -> str:
        old = len(self.text)
        self.text += new
        for s in self.stop:
            at = self.text.find(s, max(0, old - len(s) + 1))
            if at >= 0:
                self.stopped = True
                out, self.sent = self.text[self.sent:at], at
                return out
        end = len(self.text) if final else max(self.sent, len(self.text) - self.hold)
        out, self.sent = self.text[self.sent:end], end
        return out

    def add(self, token: int) -> str:
        if self.stopped:
            return ""
        self.ids.append(token)
        return self._advance(self._new_text(), final=False)

    def flush(self) -> str:
        if self.stopped:
            return ""
        return self._advance(self._new_text(final=True), final=True)
