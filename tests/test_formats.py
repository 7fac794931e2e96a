"""The target's weight format (onlinespec.formats): converted copies live in the cache, their
quality is measured and a copy that loses it is refused, and ``auto`` follows the cost model."""

from __future__ import annotations

import pytest

from onlinespec import formats
from onlinespec.formats import FormatError, check_format, ms_per_token

pytest.importorskip("llama_cpp")


@pytest.fixture(scope="module")
def shipped():
    from onlinespec.models import default_gguf_path

    return default_gguf_path()


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    """Conversions go to a cache of this module's own (none beside the shipped file)."""
    mp = pytest.MonkeyPatch()
    mp.setenv("ONLINESPEC_CACHE", str(tmp_path_factory.mktemp("cache")))
    yield
    mp.undo()


def test_unknown_formats_are_refused_with_the_choices():
    with pytest.raises(FormatError, match="as-is, auto or one of .*q8_0"):
        check_format("q3_xs")
    assert check_format("Q8-0") == "q8_0"


def test_q8_0_copy_is_served_from_the_cache_and_keeps_the_quality(shipped, cache):
    before = sorted(p.name for p in shipped.parent.iterdir())
    served = formats.served_file(shipped, "q8_0", quality_tokens=1024)
    assert served != shipped and served.exists() and served.read_bytes()[:4] == b"GGUF"
    assert "formats" in served.parts and shipped.parent not in served.parents
    assert sorted(p.name for p in shipped.parent.iterdir()) == before  # nothing written beside the user's file
    found = formats.measured_variant(shipped, "q8_0", 1024)
    assert found.quality_tokens >= 1000 and abs(found.perplexity_rise) < formats.MAX_PERPLEXITY_RISE
    assert formats.served_file(shipped, "as-is") == shipped


def test_a_copy_that_loses_quality_is_refused_with_what_to_do(shipped, cache):
    """Requantising the shipped 4-bit file to another 4-bit format costs far more than 1%."""
    with pytest.raises(FormatError, match=r"loses quality: perplexity .* as-is, or choose q8_0 or f16"):
        formats.served_file(shipped, "q4_0", quality_tokens=1024)


def test_the_torch_backend_refuses_a_format(shipped):
    from onlinespec.models import load_target

    with pytest.raises(ValueError, match="formats are llama.cpp's"):
        load_target("default", backend="torch", device="cpu", target_format="q8_0")


def test_auto_follows_the_cost_model():
    """Curves shaped like this CPU's (docs/cpu-speculation.md): a 4-bit file whose extra verified
    tokens cost nearly a step each, and a Q8_0 one slower per step but cheap to widen."""
    q4_1 = [9.2, 14.8, 19.0, 22.6, 27.3, 31.0, 35.0, 39.4]
    q8_0 = [11.5, 17.4, 20.3, 21.0, 23.8, 25.5, 27.5, 29.5]
    # low acceptance: speculation earns little, the faster single step wins (and no draft at all)
    assert ms_per_token(q4_1, 0.3, 1.0) == pytest.approx(9.2)
    assert ms_per_token(q4_1, 0.3, 1.0) < ms_per_token(q8_0, 0.3, 1.0)
    # high acceptance: the file that verifies cheaply wins
    assert ms_per_token(q8_0, 0.85, 0.5) < 0.9 * ms_per_token(q4_1, 0.85, 0.5)


def test_auto_prices_the_prompt_too():
    """This CPU's measured costs (docs/cpu-speculation.md, 2026-12-07): Q8_0 decodes a little
    slower than the shipped Q4_1 but reads a prompt 1.7x faster (Q4_1 has no batched kernels)."""
    q4_1 = formats.Costs([8.8, 16.7, 23.4, 25.6, 32.2, 34.5, 41.9, 43.9], prompt_ms=3.84)
    q8_0 = formats.Costs([9.9, 16.4, 21.0, 23.7, 28.0, 29.0, 30.5, 31.9], prompt_ms=2.21)
    # a chat turn (the prompt twice the answer): Q8_0 serves it faster
    assert q8_0.request_ms(None, 0.0, 256, 128) < 0.9 * q4_1.request_ms(None, 0.0, 256, 128)
    # decoding alone (no prompt to speak of), the target alone: Q4_1's cheaper step wins
    assert q4_1.request_ms(None, 0.0, 1, 128) < q8_0.request_ms(None, 0.0, 1, 128)
    # the same at high acceptance: Q8_0's cheaper wide verification wins
    assert q8_0.request_ms(0.9, 0.5, 1, 128) < q4_1.request_ms(0.9, 0.5, 1, 128)


def test_auto_records_its_choice_and_serves_it_from_then_on(shipped, cache):
    from onlinespec.models import load_target

    assert formats.served_file(shipped, "auto") == shipped  # nothing chosen on this machine yet: the file as it is
    choice = formats.choose(shipped, None, None, candidates=("q8_0",), quality_tokens=1024)
    assert set(choice.request_ms) == {"as-is", "q8_0"} and choice.format in choice.request_ms
    faster = min(choice.request_ms, key=choice.request_ms.get)
    assert choice.format in (faster, "as-is")  # another format must win by MIN_GAIN to replace the file as it is
    assert formats.served_file(shipped, "auto") == choice.path  # recorded: a server's start reads it
    assert load_target("default").gguf == choice.path  # auto is the default
    formats.remove_variants(shipped)
    assert formats.served_file(shipped, "auto") == shipped  # the copies and the choice gone: the file as it is
