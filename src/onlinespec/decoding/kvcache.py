"""Small helpers over Hugging Face caches (transformers 5: ``crop`` takes a negative count)."""

from __future__ import annotations

from transformers import Cache


def truncate_cache(cache: Cache, length: int) -> None:
    """Keep the first ``length`` positions of ``cache``."""
    extra = cache.get_seq_length() - length
    if extra > 0:
        cache.crop(-extra)
