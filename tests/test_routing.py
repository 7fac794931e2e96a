"""The router: which draft serves a request."""

import pytest

from onlinespec.routing.domains import SHARED, Router, draft_name


def test_domain_router_gives_each_domain_its_own_draft_up_to_the_cap():
    router = Router("domain", max_drafts=2)
    assert [router(d) for d in ("code", "math", "code", "chat", "math")] == ["code", "math", "code", SHARED, "math"]
    assert router.drafts == ["code", "math"]


def test_single_router_sends_everything_to_one_draft():
    router = Router("single")
    assert {router(d) for d in ("code", "math", "chat")} == {SHARED}


def test_a_restart_keeps_the_domains_that_have_drafts_on_disk():
    router = Router("domain", max_drafts=2, known=["chat", "code"])
    assert router("math") == SHARED and router("code") == "code"


def test_domain_labels_become_safe_folder_names():
    assert draft_name("maths (de)/v2") == "maths_de_v2"
    assert draft_name("../..") == SHARED and draft_name("  ") == SHARED


def test_bad_router_settings_say_what_to_use():
    with pytest.raises(ValueError, match="single"):
        Router("topic")
    with pytest.raises(ValueError, match="max_drafts"):
        Router("domain", max_drafts=0)
