"""Splits never overlap and stay put; streams follow their schedule."""

from collections import Counter

import pytest

from onlinespec.data.sources import Query
from onlinespec.data.splits import SPLITS, split, split_of
from onlinespec.data.streams import abrupt_shifts, gradual_mix, random_mix


def pool(domain, n):
    return [Query(id=f"{domain}/{i}", domain=domain, origin="test", prompt=f"{domain} {i}") for i in range(n)]


def test_splits_are_disjoint_complete_and_stable():
    queries = pool("chat", 2000)
    parts = {name: split(queries, name) for name in SPLITS}
    ids = [q.id for part in parts.values() for q in part]
    assert len(ids) == len(set(ids)) == 2000
    shares = {name: len(part) / 2000 for name, part in parts.items()}
    assert shares == pytest.approx({"warmup": 0.5, "online": 0.3, "heldout": 0.2}, abs=0.04)
    # a query's split depends on its id alone, not on what else is in the pool
    assert [split_of(q.id) for q in queries[:50]] == [split_of(q.id) for q in pool("chat", 50)]


def test_abrupt_shifts_follow_the_schedule():
    stream = abrupt_shifts({"math": pool("math", 30), "code": pool("code", 30), "chat": pool("chat", 30)}, every=20)
    assert [q.domain for q in stream] == ["math"] * 20 + ["code"] * 20 + ["chat"] * 20
    assert len({q.id for q in stream}) == 60


def test_gradual_mix_shifts_share_smoothly():
    stream = gradual_mix({"math": pool("math", 400), "code": pool("code", 400)}, every=200, seed=1)
    first = Counter(q.domain for q in stream[:100])
    second = Counter(q.domain for q in stream[100:200])
    assert first["code"] < second["code"] < 100  # the next domain's share rises within the block
    assert all(q.domain == "code" for q in stream[200:])
    assert len({q.id for q in stream}) == 400


def test_random_mix_weights_and_errors():
    stream = random_mix({"a": pool("a", 900), "b": pool("b", 900)}, n=900, weights={"a": 2, "b": 1}, seed=0)
    assert Counter(q.domain for q in stream)["a"] == pytest.approx(600, abs=60)
    with pytest.raises(ValueError, match="pool has 3"):
        abrupt_shifts({"a": pool("a", 3)}, every=5)
    with pytest.raises(ValueError, match="fractions"):
        split_of("x", (0.5, 0.5, 0.5))
