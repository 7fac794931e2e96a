"""What each drafter declares it can do (the engine, the pool and the server read these instead of
probing the object): read the target's features, have its model swapped, learn through a suffix
index; and what its proposals are tagged with."""

from __future__ import annotations

from onlinespec.decoding.proposers.draft_model import DraftModelProposer
from onlinespec.decoding.proposers.feature import FeatureHeadProposer
from onlinespec.decoding.proposers.hybrid import HybridProposer
from onlinespec.decoding.proposers.ngram import NgramProposer
from onlinespec.decoding.proposers.suffix import SuffixIndex, SuffixProposer
from tests.drafts.test_feature_head import random_head


def capabilities(proposer) -> tuple[bool, bool, bool, str]:
    return proposer.uses_features, proposer.swappable, proposer.suffix_index is not None, proposer.drafter


def test_each_drafter_declares_what_it_can_do(tiny_target, tiny_draft):
    head = FeatureHeadProposer(random_head(tiny_target), version="v3")
    assert capabilities(head) == (True, True, False, "head") and head.version == "v3"
    assert capabilities(DraftModelProposer(tiny_draft)) == (False, True, False, "draft")
    assert capabilities(NgramProposer()) == (False, False, False, "ngram") and NgramProposer().version is None
    assert capabilities(SuffixProposer()) == (False, False, True, "suffix")
    # a hybrid reads features when its learned draft does, and learns through it (and its index)
    assert capabilities(HybridProposer(head, suffix_index=SuffixIndex()))[:3] == (True, True, True)
    hybrid = HybridProposer(DraftModelProposer(tiny_draft, version="v7"))
    assert capabilities(hybrid)[:3] == (False, True, False) and hybrid.version == "v7"
