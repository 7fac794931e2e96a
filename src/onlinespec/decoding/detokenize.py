"""Incremental detokenisation: the text of a growing list of tokens, at a cost that follows the new
tokens, not the whole output.

:class:`IncrementalText` keeps the text decoded so far and decodes only a small window: the tokens
of the last chunk it committed (context) and the tokens not yet committed (pending). The text of
the pending tokens is what ``decode(window)`` adds to ``decode(context)``: the prefix-offset method
of Hugging Face's TGI and vLLM's ``detokenize_incrementally``, over the tokenizer's own
``decode(ids, skip_special_tokens=True)``, so the text is byte for byte the one a single decode of
the whole output gives (for byte-level BPE, SentencePiece/Metaspace and WordPiece decoders).

Text that ends in U+FFFD (a character whose bytes have not all come) stays pending until it is
complete. ``tokenizers.decoders.DecodeStream`` does the same in Rust but was not used: it has no
way to flush a partial character at the end, skips transformers' clean-up step, and its buffer
grows without bound while tokens add no text (special tokens, stray bytes). Here a run of tokens
that keeps ending in U+FFFD is committed up to a split that decodes the same in two parts as in
one (:meth:`IncrementalText._force`), and tokens that add no text leave the window.
"""

from __future__ import annotations

from bisect import bisect_right
from dataclasses import dataclass, field

REPLACEMENT = "\ufffd"
MAX_PENDING = 8  # tokens left pending (ending in U+FFFD) before a split is looked for (a character takes at most 4)
SPLITS_TRIED = 4  # splits tried then, from 3 tokens before the end backwards


@dataclass
class IncrementalText:
    tokenizer: object  # anything with decode(ids, skip_special_tokens=True)
    ids: list[int]  # the live token list (StopChecker.generated); this reads ids[:fed]
    fed: int = 0  # tokens of ids consumed
    window: list[int] = field(default_factory=list)  # context tokens, then pending tokens
    read: int = 0  # window[:read]: context (its text is committed); window[read:]: pending
    base: str | None = ""  # decode(window[:read]); None: not decoded yet
    pending: str = ""  # the provisional text of window[read:] (may end in an incomplete character)
    pieces: list[str] = field(default_factory=list)  # the committed text, in pieces
    ends: list[int] = field(default_factory=list)  # where each piece ends in the text
    special: frozenset[int] | None = None  # the tokenizer's special ids, read when first needed

    @property
    def length(self) -> int:
        """Characters committed (final: later tokens never change them)."""
        return self.ends[-1] if self.ends else 0

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def catch_up(self, end: int | None = None) -> str:
        """Consume ``ids[fed:end]`` (default: all); return the text they commit."""
        end = len(self.ids) if end is None else end
        if end <= self.fed:
            return ""
        waited = len(self.window) - self.read  # pending tokens before these
        self.window.extend(self.ids[self.fed:end])
        self.fed = end
        if self.base is None:
            self.base = self.decode(self.window[: self.read])
        full = self.decode(self.window)
        if full.startswith(self.base):
            new = full[len(self.base):]
        else:  # a decoder whose text for more tokens does not extend its text for fewer: decode it all
            new, full = self.decode(self.ids[:end])[self.length:], None
        if not new.endswith(REPLACEMENT):
            return self._commit(len(self.window), new)
        self.pending = new
        if full is not None and waited > MAX_PENDING:  # (not at a first read of many tokens: the split would cost more)
            return self._force(full)
        return ""

    def _commit(self, end: int, new: str) -> str:
        """window[read:end] decodes to ``new`` after the context: commit it. Tokens with text
        become the context; tokens that add none leave the window (decoding them again would be
        wasted), unless nothing came before them: then they may still shape the text (a decoder
        that strips the first space), and they stay in the context."""
        chunk = self.window[self.read:end]
        if new:
            self.pieces.append(new)
            self.ends.append(self.length + len(new))
            del self.window[: self.read]
            self.read, self.base = len(chunk), None
        elif self.length or self._all_special(chunk):  # skipped special tokens, or nothing after text
            del self.window[self.read:end]
        else:
            self.read = end  # base is still decode(window[:read]): the chunk added nothing
        self.pending = ""
        return new

    def _force(self, full: str) -> str:
        """Pending tokens that keep ending in U+FFFD (bytes that never make a character): commit
        them up to a split where the two parts decode to ``full`` as the whole does. Such a split
        stays clean whatever comes after (the left part ends in a whole or a broken character);
        the last 3 tokens may hold the start of a character still to come, so they stay."""
        for j in range(len(self.window) - 3, max(self.read, len(self.window) - 3 - SPLITS_TRIED), -1):
            left, right = self.decode(self.window[:j]), self.decode(self.window[j:])
            if left + right == full and left.startswith(self.base):
                new = left[len(self.base):]
                self._commit(j, new)
                self.pending = right
                return new
        return ""

    def _all_special(self, ids: list[int]) -> bool:
        if self.special is None:
            self.special = frozenset(getattr(self.tokenizer, "all_special_ids", ()) or ())
        return all(t in self.special for t in ids)

    def slice(self, start: int, stop: int | None = None) -> str:
        """Committed text[start:stop], joining only the pieces it spans."""
        stop = self.length if stop is None else min(stop, self.length)
        if start >= stop:
            return ""
        first = bisect_right(self.ends, start)
        last = bisect_right(self.ends, stop - 1)
        offset = self.ends[first - 1] if first else 0
        return "".join(self.pieces[first: last + 1])[start - offset: stop - offset]

    def text(self) -> str:
        """All the text of the consumed tokens, a trailing partial character included (as U+FFFD,
        as a single decode gives it)."""
        if len(self.pieces) > 1:
            self.pieces, self.ends = ["".join(self.pieces)], [self.length]
        return (self.pieces[0] if self.pieces else "") + self.pending

    def snapshot(self) -> tuple:
        return (self.fed, list(self.window), self.read, self.base, self.pending, len(self.pieces))

    def restore(self, state: tuple) -> None:
        self.fed, window, self.read, self.base, self.pending, n = state
        self.window = list(window)
        del self.pieces[n:], self.ends[n:]
