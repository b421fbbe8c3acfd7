"""Streaming detokenisation and stop strings.

Decoding token by token breaks multi-byte characters and BPE merges, so, as vLLM does, we
decode a small window of recent tokens and emit only the text that grew and is complete.
"""

from __future__ import annotations

from ..tokenizer import Tokenizer


class StreamingDetokenizer:
    """Feed tokens one at a time; get back the new text each one completes."""

    def __init__(self, tokenizer: Tokenizer):
        self.tokenizer = tokenizer
        self.tokens: list[int] = []
        self.prefix_offset = 0
        self.read_offset = 0

    def add(self, token: int) -> str:
        self.tokens.append(token)
        prefix = self.tokenizer.decode(self.tokens[self.prefix_offset : self.read_offset])
        text = self.tokenizer.decode(self.tokens[self.prefix_offset :])
        if len(text) > len(prefix) and not text.endswith("\ufffd"):
            self.prefix_offset, self.read_offset = self.read_offset, len(self.tokens)
            return text[len(prefix) :]
        return ""

    def flush(self) -> str:
        """Whatever is still held back (an incomplete character at the very end)."""
        prefix = self.tokenizer.decode(self.tokens[self.prefix_offset : self.read_offset])
        text = self.tokenizer.decode(self.tokens[self.prefix_offset :])
        self.prefix_offset = self.read_offset = len(self.tokens)
        return text[len(prefix) :]


class StopMatcher:
    """Holds back text that could be the start of a stop string; reports a full match."""

    def __init__(self, stops: list[str]):
        self.stops = [s for s in stops if s]
        self.pending = ""

    def feed(self, text: str) -> tuple[str, bool]:
        """Returns (text safe to emit, stopped)."""
        self.pending += text
        if not self.stops:
            out, self.pending = self.pending, ""
            return out, False
        hits = [i for i in (self.pending.find(s) for s in self.stops) if i >= 0]
        if hits:
            out, self.pending = self.pending[: min(hits)], ""
            return out, True
        keep = max((k for s in self.stops for k in range(1, len(s)) if self.pending.endswith(s[:k])), default=0)
        out = self.pending[: len(self.pending) - keep]
        self.pending = self.pending[len(out) :]
        return out, False

    def flush(self) -> str:
        out, self.pending = self.pending, ""
        return out
