"""When to stop a request: EOS, stop token ids, stop strings, max_new_tokens, without overshooting any of them.

A speculative round emits several tokens at once; :meth:`StopChecker.clip` cuts a round's tokens
at the first stop condition, so the output is the same as when tokens come one at a time.

The text work of a step follows its new tokens, not the output so far: the text is decoded
incrementally (:class:`~onlinespec.decoding.detokenize.IncrementalText`), and stop strings are
searched in the new text and the last (longest stop string - 1) characters before it only.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from onlinespec.decoding.detokenize import REPLACEMENT, IncrementalText
from onlinespec.decoding.sampling import SamplingParams


@dataclass
class StopChecker:
    params: SamplingParams
    eos_token_ids: frozenset[int] = frozenset()
    tokenizer: object | None = None  # needed for stop strings and text only
    generated: list[int] = field(default_factory=list)  # the output's tokens (the text reads this very list)
    finish_reason: str | None = None  # "eos" | "stop" | "length" once finished
    max_new_tokens: int | None = None  # the budget SpeculativeEngine.budget resolved (None: params.max_new_tokens)
    _text: IncrementalText | None = field(default=None, init=False, repr=False)
    _cut: int | None = field(default=None, init=False, repr=False)  # where the first stop string starts in the text
    _longest: int = field(default=0, init=False, repr=False)  # the longest stop string's length

    def __post_init__(self) -> None:
        if self.max_new_tokens is None:
            self.max_new_tokens = self.params.max_new_tokens
        if self.max_new_tokens is None:
            raise ValueError("max_new_tokens=None (all the context leaves) needs the prompt: pass SpeculativeEngine.budget's answer")
        if self.params.stop_strings and self.tokenizer is None:
            raise ValueError("stop strings need a tokenizer")
        if self.params.ignore_eos:
            self.eos_token_ids = frozenset()
        if self.tokenizer is not None:
            self._text = IncrementalText(self.tokenizer, self.generated)
        self._longest = max((len(s) for s in self.params.stop_strings), default=0)

    @property
    def held_back(self) -> frozenset[int]:
        """The tokens ``min_tokens`` holds back: EOS (unless ignored) and the stop token ids."""
        return self.eos_token_ids | frozenset(self.params.stop_token_ids)

    @property
    def remaining(self) -> int:
        return self.max_new_tokens - len(self.generated)

    def clip(self, new_tokens: list[int]) -> list[int]:
        """Append a round's tokens, cut at the first stop condition; return the tokens kept."""
        start = len(self.generated)
        kept: list[int] = []
        for token in new_tokens:
            kept.append(token)
            self.generated.append(token)
            if token in self.eos_token_ids:
                self.finish_reason = "eos"
            elif token in self.params.stop_token_ids:
                self.finish_reason = "stop"
            elif self.remaining == 0:
                self.finish_reason = "length"
            if self.finish_reason:
                break
        end = self._stop_string_end(start) if self.params.stop_strings else None
        if end is not None:  # a stop string comes before (or with) the token that ended the round
            if end < len(self.generated) or self.finish_reason != "eos":  # EOS first, as one token at a time
                self.finish_reason = "stop"
            del kept[end - start:], self.generated[end:]
        return kept

    def _stop_string_end(self, start: int) -> int | None:
        """How many tokens the output keeps when a stop string ends it: the first token, from
        ``min_tokens`` on, after which the text holds one (an earlier one too: the text is cut at
        the first). The round's text is decoded at once; token by token only when it stops."""
        before = (self._text.snapshot(), self._cut)
        self._read(len(self.generated))
        if self._cut is None or len(self.generated) < self.params.min_tokens:
            return None
        self._text.restore(before[0])
        self._cut = before[1]
        for end in range(start + 1, len(self.generated) + 1):
            self._read(end)
            if self._cut is not None and end >= self.params.min_tokens:
                return end
        raise AssertionError("the round's text held a stop string, token by token none")

    def _read(self, end: int) -> None:
        """Decode ``generated`` up to ``end``, and look for stop strings in the new text."""
        before = self._text.length
        self._text.catch_up(end)
        self._scan(before, final=False)

    def _scan(self, before: int, final: bool) -> int | None:
        """The first stop string that ends past character ``before``: only the text from
        (longest - 1) characters before it is searched. A trailing partial character (U+FFFD)
        may still change, so it is searched only when ``final``."""
        if not self.params.stop_strings:
            return None
        start = max(0, before - self._longest + 1)
        text = self._text.slice(start) + self._text.pending
        if not final and self._text.pending.endswith(REPLACEMENT):
            text = text[:-1]
        found = None
        for s in self.params.stop_strings:
            i = text.find(s, max(0, before - len(s) + 1) - start)
            if i >= 0 and (found is None or start + i < found):
                found = start + i
        if found is not None and (self._cut is None or found < self._cut):
            self._cut = found
        return found

    def streamable(self) -> int:
        """How many characters of the text may be streamed before the request finishes: the whole
        characters decoded so far, up to the first stop string, less an end that may be the start
        of one (or of one that would start earlier). Looks at the last (longest - 1) only."""
        self._need_text()
        if self._text.fed < len(self.generated):
            self._read(len(self.generated))
        end = self._text.length if self._cut is None else min(self._cut, self._text.length)
        if self.params.stop_strings:
            end -= stop_prefix_length(self._text.slice(max(0, end - self._longest + 1), end), self.params.stop_strings)
        return end

    def text_between(self, start: int, stop: int) -> str:
        """Characters ``start:stop`` of the text (within :meth:`streamable`'s answer)."""
        return self._text.slice(start, stop)

    def text(self, tokens: list[int] | None = None) -> str:
        """The generated text, without special tokens, cut before the first stop string
        (``tokens``: the text of those tokens instead, decoded at once)."""
        if tokens is not None:
            return cut_at_stop_string(self.tokenizer.decode(tokens, skip_special_tokens=True), self.params.stop_strings)
        self._need_text()
        self._read(len(self.generated))
        self._scan(self._text.length, final=True)
        text = self._text.text()
        return text if self._cut is None else text[: self._cut]

    def _need_text(self) -> None:
        if self._text is None:
            raise ValueError("the text needs a tokenizer")


ANCHOR = 8  # a long start is looked for by the stop string's first characters, not its first one


def stop_prefix_length(tail: str, stop_strings: tuple[str, ...]) -> int:
    """The longest end of ``tail`` that is the start (not the whole) of a stop string."""
    held = 0
    for s in stop_strings:
        if not tail or s.find(tail[-1], 0, len(s) - 1) < 0:  # the last character starts no end of s
            continue
        first = max(0, len(tail) - len(s) + 1)
        anchor = s[:ANCHOR]
        i = tail.find(anchor, first)  # ends of ANCHOR characters or more, longest first
        while 0 <= i and len(tail) - i > held:
            if s.startswith(tail[i:]):
                held = len(tail) - i
                break
            i = tail.find(anchor, i + 1)
        for n in range(min(len(anchor) - 1, len(tail) - first), held, -1):  # the shorter ones
            if s[n - 1] == tail[-1] and tail.endswith(s[:n]):
                held = n
                break
    return held


def cut_at_stop_string(text: str, stop_strings: tuple[str, ...]) -> str:
    cut = min((i for i in (text.find(s) for s in stop_strings) if i >= 0), default=len(text))
    return text[:cut]
