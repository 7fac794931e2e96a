"""The text a request streams and ends with, and where stop strings end it, read incrementally
(onlinespec.decoding.stopping, onlinespec.decoding.detokenize) with the default target's real
tokenizer: byte-level BPE, whose tokens split emoji, CJK and accented characters into bytes."""

from __future__ import annotations

import random

import pytest

from onlinespec.decoding.request import RequestState
from onlinespec.decoding.sampling import SamplingParams
from onlinespec.decoding.speculative import text_delta
from onlinespec.decoding.stopping import StopChecker, stop_prefix_length

TEXTS = [
    "Café crème, naïve façade; Ångström über straße.",
    "Say 你好, 世界! 東京で会いましょう。",
    "Emoji: 😀 👍🏽 🇯🇵 👨‍👩‍👧 done.",
    "\n😀😀😀 mixed 日本語 and ü😀é\n",
]
EOS = 2  # <|im_end|>, a special token: skipped in the text


class CountingTokenizer:
    """The real tokenizer, counting the tokens handed to ``decode``."""

    def __init__(self, tokenizer):
        self.tokenizer, self.decoded, self.calls = tokenizer, 0, 0

    def decode(self, ids, **kwargs):
        self.decoded += len(ids)
        self.calls += 1
        return self.tokenizer.decode(ids, **kwargs)

    def __getattr__(self, name):
        return getattr(self.tokenizer, name)


def _stream(tokenizer, ids: list[int], params: SamplingParams, round_size: int) -> tuple[RequestState, list[str]]:
    """Feed ``ids`` to a request ``round_size`` at a time, as the engine's rounds do; return it
    and the pieces of text it streamed (text_delta, what the server sends)."""
    request = RequestState([1], params, StopChecker(params, frozenset({EOS}), tokenizer))
    pieces, emitted, i = [], "", 0
    while not request.finished:
        request.stop.clip(ids[i: i + round_size])
        i += round_size
        delta, emitted = text_delta(request, emitted)
        pieces.append(delta)
    return request, pieces


def _splits_a_character(tokenizer, ids: list[int]) -> bool:
    return any(tokenizer.decode(ids[:n]).endswith("\ufffd") for n in range(1, len(ids)))


@pytest.mark.parametrize("round_size", [1, 3, 5])
@pytest.mark.parametrize("text", TEXTS)
def test_streamed_text_joins_to_the_one_shot_decode(default_tokenizer, text, round_size):
    ids = default_tokenizer(text).input_ids
    assert _splits_a_character(default_tokenizer, ids)  # some token boundary falls inside a character
    request, pieces = _stream(default_tokenizer, ids, SamplingParams(max_new_tokens=len(ids)), round_size)
    assert "".join(pieces) == default_tokenizer.decode(ids, skip_special_tokens=True) == text
    assert request.stop.text() == text
    assert not any(p.endswith("\ufffd") for p in pieces)  # a partial character never streams


@pytest.mark.parametrize("round_size", [1, 4])
def test_random_tokens_stream_as_the_one_shot_decode(default_tokenizer, round_size):
    """Any token sequence: stray bytes, characters cut off by the next token, special tokens,
    an output that ends inside a character (its U+FFFD, as the one-shot decode has it)."""
    rng = random.Random(round_size)
    vocab = default_tokenizer.get_vocab()
    single_bytes = [i for token, i in vocab.items() if len(token) == 1]
    pool = sorted({t for text in TEXTS for t in default_tokenizer(text).input_ids})
    for _ in range(60):
        ids = [rng.choice(single_bytes) if rng.random() < 0.3 else rng.choice([0, 1]) if rng.random() < 0.05
               else rng.choice(pool) if rng.random() < 0.7 else rng.randrange(len(default_tokenizer))
               for _ in range(rng.randrange(1, 50))]
        want = default_tokenizer.decode(ids, skip_special_tokens=True)
        request, pieces = _stream(default_tokenizer, ids, SamplingParams(max_new_tokens=len(ids)), round_size)
        assert "".join(pieces) == request.stop.text() == want


def test_an_output_that_ends_inside_a_character_ends_as_the_one_shot_decode(default_tokenizer):
    ids = default_tokenizer("ok 😀").input_ids[:-1]  # the emoji's last byte never comes
    want = default_tokenizer.decode(ids, skip_special_tokens=True)
    assert want.endswith("\ufffd")
    request, pieces = _stream(default_tokenizer, ids, SamplingParams(max_new_tokens=len(ids)), 2)
    assert "".join(pieces) == request.stop.text() == want


def _spanning_stops(tokenizer, ids: list[int]) -> list[str]:
    """Stop strings that the text of ``ids`` holds across a token boundary (2 to 6 characters)."""
    text, stops = tokenizer.decode(ids), []
    for n in range(1, len(ids)):
        at = len(tokenizer.decode(ids[:n]).rstrip("\ufffd"))  # a boundary (or the character it cuts)
        for before, after in ((1, 1), (2, 3), (3, 1)):
            stop = text[max(0, at - before): at + after]
            if len(stop) >= 2 and "\ufffd" not in stop and stop not in stops:
                stops.append(stop)
    return stops


@pytest.mark.parametrize("round_size", [1, 4])
@pytest.mark.parametrize("text", TEXTS)
def test_a_stop_string_across_tokens_stops_where_one_token_at_a_time_does(default_tokenizer, text, round_size):
    """The request ends with the first token whose text completes the stop string (the one-shot
    decode of the output so far holds it); the text ends before it; nothing of it streams."""
    ids = default_tokenizer(text).input_ids
    stops = _spanning_stops(default_tokenizer, ids)
    assert len(stops) > 10
    for stop in stops:
        n = next(n for n in range(1, len(ids) + 1) if stop in default_tokenizer.decode(ids[:n]))
        request, pieces = _stream(default_tokenizer, ids, SamplingParams(max_new_tokens=len(ids), stop_strings=(stop,)), round_size)
        want = text[: text.index(stop)]
        assert (request.stop.generated, request.stop.finish_reason) == (ids[:n], "stop"), stop
        assert request.stop.text() == "".join(pieces) == want, stop


def test_the_first_of_several_stop_strings_cuts_the_text(default_tokenizer):
    ids = default_tokenizer("alpha beta gamma delta").input_ids
    params = SamplingParams(max_new_tokens=len(ids), stop_strings=("delta", " gam", "a be"))
    request, pieces = _stream(default_tokenizer, ids, params, 3)
    assert request.stop.text() == "".join(pieces) == "alph"
    n = next(n for n in range(1, len(ids)) if "a be" in default_tokenizer.decode(ids[:n]))
    assert request.stop.generated == ids[:n] and n < len(ids)  # the first to complete, not the first listed


def test_min_tokens_lets_a_stop_string_end_the_request_only_from_there(default_tokenizer):
    """A stop string before min_tokens does not end the request; the request ends at min_tokens,
    its text cut before that stop string (the text never holds a stop string)."""
    ids = default_tokenizer(" one, two, three, four, five, six").input_ids
    request, pieces = _stream(default_tokenizer, ids, SamplingParams(max_new_tokens=len(ids), stop_strings=(",",), min_tokens=6), 4)
    assert request.stop.generated == ids[:6] and request.stop.finish_reason == "stop"
    assert request.stop.text() == "".join(pieces) == " one"
    request, _ = _stream(default_tokenizer, ids, SamplingParams(max_new_tokens=len(ids), stop_strings=("never",), min_tokens=6), 4)
    assert request.stop.finish_reason == "length"


def test_eos_and_stop_token_ids_end_the_request_as_before(default_tokenizer):
    ids = default_tokenizer("Hello there, world").input_ids
    request, pieces = _stream(default_tokenizer, ids[:2] + [EOS] + ids[2:], SamplingParams(max_new_tokens=10), 4)
    assert request.stop.finish_reason == "eos" and request.stop.generated == ids[:2] + [EOS]
    assert request.stop.text() == "".join(pieces) == default_tokenizer.decode(ids[:2])
    params = SamplingParams(max_new_tokens=10, stop_token_ids=(ids[1],), stop_strings=("zz",))
    request, pieces = _stream(default_tokenizer, ids, params, 4)
    assert request.stop.finish_reason == "stop" and request.stop.generated == ids[:2]


def test_stop_prefix_length_takes_the_longest_start_of_any_stop_string():
    assert stop_prefix_length("the en", ("end", "xyz")) == 2
    assert stop_prefix_length("the en", ("nope", "en route")) == 2
    assert stop_prefix_length("the en", ("the end",)) == 6
    assert stop_prefix_length("xa", ("ab", "xab")) == 2  # the longest, not one after another
    assert stop_prefix_length("the end", ("end",)) == 0  # a whole stop string is not held back: it is cut
    assert stop_prefix_length("", ("end",)) == 0


def _decoded_per_token(tokenizer, ids: list[int], stops: tuple[str, ...], round_size: int = 4) -> float:
    counting = CountingTokenizer(tokenizer)
    request, pieces = _stream(counting, ids, SamplingParams(max_new_tokens=len(ids), stop_strings=stops), round_size)
    assert "".join(pieces) == request.stop.text() == tokenizer.decode(ids, skip_special_tokens=True)
    return counting.decoded / len(ids)


def test_text_work_per_token_does_not_grow_with_the_output(default_tokenizer):
    """16 stop strings of 1,000 characters, streamed: each step decodes its new tokens and a few
    before them, not the output (nor 1,000 characters' worth of it) again. Before: 322 tokens
    decoded per token of a 512-token output; the work grew with the square of the output."""
    rng = random.Random(0)
    stops = tuple("".join(rng.choice("qxzjv") for _ in range(1000)) for _ in range(16))
    ids = (default_tokenizer(" ".join(TEXTS)).input_ids * 40)[:1024]
    for n in (128, 512, 1024):
        assert _decoded_per_token(default_tokenizer, ids[:n], stops) <= 5
        assert _decoded_per_token(default_tokenizer, ids[:n], ()) <= 5
    assert _decoded_per_token(default_tokenizer, ids[:512], stops, round_size=1) <= 5


def test_tokens_that_never_make_text_do_not_pile_up(default_tokenizer):
    """A client can steer the output (logit_bias) to stray bytes, or to special tokens: text that
    keeps ending in U+FFFD, or no text at all. The work per token stays bounded there too."""
    stray = default_tokenizer.get_vocab()["\u0122"]  # byte 0x80 on its own: a broken character
    hello = default_tokenizer("Hi 你好").input_ids
    for ids in ([stray] * 512, hello + [stray] * 500 + hello, [1] * 512, hello + [1] * 500 + hello):
        assert _decoded_per_token(default_tokenizer, ids, ("a" * 1000,)) <= 12
