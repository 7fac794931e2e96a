"""Learned drafts that are not plain language models (the feature-conditioned head)."""

from onlinespec.decoding.feature_head import FeatureHead, FeatureHeadConfig, frequent_vocab, is_feature_head

__all__ = ["FeatureHead", "FeatureHeadConfig", "frequent_vocab", "is_feature_head"]
