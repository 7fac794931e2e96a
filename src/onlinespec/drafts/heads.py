"""Saved feature heads: the packaged default and loading one checked against its target."""

from __future__ import annotations

from pathlib import Path

from onlinespec.decoding.feature_head import FeatureHead, is_feature_head
from onlinespec.models import LoadedModel, check_same_tokenizer_hash

DEFAULT_HEAD = Path(__file__).resolve().parents[1] / "assets" / "default-head"


def load_head(folder: str | Path, target: LoadedModel) -> FeatureHead:
    """A saved feature head, checked against the target it is asked to draft for."""
    folder = Path(folder)
    if not is_feature_head(folder):
        hint = " (build it with `onlinespec warmup`)" if folder == DEFAULT_HEAD else ""
        raise FileNotFoundError(f"no feature head in {folder}{hint}")
    info = FeatureHead.info(folder)
    check_same_tokenizer_hash(info.get("tokenizer"), target.tokenizer, str(folder))
    return FeatureHead.load(folder, target.model)
