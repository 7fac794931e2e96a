"""When to stop a request: EOS, stop token ids, stop strings, max_new_tokens, without overshooting any of them.

A speculative round emits several tokens at once; :meth:`StopChecker.clip` cuts a round's tokens
at the first stop condition, so the output is the same as when tokens come one at a time.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from onlinespec.decoding.sampling import SamplingParams


@dataclass
class StopChecker:
    params: SamplingParams
    eos_token_ids: frozenset[int] = frozenset()
    tokenizer: object | None = None  # needed for stop strings only
    generated: list[int] = field(default_factory=list)
    finish_reason: str | None = None  # "eos" | "stop" | "length" once finished
    max_new_tokens: int | None = None  # the budget SpeculativeEngine.budget resolved (None: params.max_new_tokens)

    def __post_init__(self) -> None:
        if self.max_new_tokens is None:
            self.max_new_tokens = self.params.max_new_tokens
        if self.max_new_tokens is None:
            raise ValueError("max_new_tokens=None (all the context leaves) needs the prompt: pass SpeculativeEngine.budget's answer")
        if self.params.stop_strings and self.tokenizer is None:
            raise ValueError("stop strings need a tokenizer")
        if self.params.ignore_eos:
            self.eos_token_ids = frozenset()

    @property
    def held_back(self) -> frozenset[int]:
        """The tokens ``min_tokens`` holds back: EOS (unless ignored) and the stop token ids."""
        return self.eos_token_ids | frozenset(self.params.stop_token_ids)

    @property
    def remaining(self) -> int:
        return self.max_new_tokens - len(self.generated)

    def clip(self, new_tokens: list[int]) -> list[int]:
        """Append a round's tokens, cut at the first stop condition; return the tokens kept."""
        kept: list[int] = []
        for token in new_tokens:
            kept.append(token)
            self.generated.append(token)
            if token in self.eos_token_ids:
                self.finish_reason = "eos"
            elif token in self.params.stop_token_ids:
                self.finish_reason = "stop"
            elif self.params.stop_strings and len(self.generated) >= self.params.min_tokens and self._stop_string_at_end():
                self.finish_reason = "stop"
            elif self.remaining == 0:
                self.finish_reason = "length"
            if self.finish_reason:
                break
        return kept

    def _stop_string_at_end(self) -> bool:
        """Did the last token complete a stop string? Decodes only as many trailing tokens as it
        takes for the text before the last token to hold a whole stop string (byte-level tokens
        can carry a fraction of a character, so that may be more tokens than characters)."""
        longest = max(len(s) for s in self.params.stop_strings)
        n = longest + 1
        while n < len(self.generated) and len(self._decode(self.generated[-n:-1]).lstrip("\ufffd")) < longest:
            n *= 2
        tail = self._decode(self.generated[-n:])
        return any(s in tail for s in self.params.stop_strings)

    def _decode(self, tokens: list[int]) -> str:
        return self.tokenizer.decode(tokens, skip_special_tokens=True)

    def text(self, tokens: list[int] | None = None) -> str:
        """The generated text, without special tokens, cut before the first stop string."""
        text = self.tokenizer.decode(self.generated if tokens is None else tokens, skip_special_tokens=True)
        return cut_at_stop_string(text, self.params.stop_strings)


def cut_at_stop_string(text: str, stop_strings: tuple[str, ...]) -> str:
    cut = min((i for i in (text.find(s) for s in stop_strings) if i >= 0), default=len(text))
    return text[:cut]
