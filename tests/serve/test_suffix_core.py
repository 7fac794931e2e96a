"""A serving core whose draft has a suffix index learns from every request it serves: the same
question again is drafted from the first answer (and answered identically), an opted-out request
is never indexed, the index survives a restart, and a purge removes a request from it. A second
tenant learns nothing from the first's text, unless the index is shared."""

from __future__ import annotations

import dataclasses

import pytest

from onlinespec.decoding.proposers.suffix_files import SUFFIX_FILE
from onlinespec.decoding.sampling import SamplingParams
from onlinespec.decoding.speculative import SpeculativeDecoder
from onlinespec.models import load_model
from onlinespec.serve.config import CoreConfig
from onlinespec.serve.core import ServingCore

def greedy(new_tokens: int) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_new_tokens=new_tokens)


def start(folder, out_dir, **options) -> ServingCore:
    options = {"speculation_details": True, **options}
    core = ServingCore(CoreConfig(target=str(folder), draft="suffix", k=4, kernels=False, adaptive_k=False, **options), out_dir)
    core.load()
    return core


def test_the_suffix_index_learns_from_served_requests_and_keeps_what_it_should(tiny_target_folder, tmp_path):
    question = [{"role": "user", "content": "Explain what a cache is, briefly."}]
    target = load_model(str(tiny_target_folder))
    core = start(tiny_target_folder, tmp_path / "run")
    try:
        first = core.submit(question, greedy(24), request_id="q1").result()
        again = core.submit(question, greedy(24), request_id="q2").result()
        private = core.submit("Something private.", greedy(8), request_id="p", train=False).result()
        index = next(iter(core.pool.drafts.values())).suffix
        assert index.stats()["requests"] == 2  # q1 and q2; never the opted-out one
        assert again.text == first.text
        assert again.stats.acceptance_rate > 0.9 > first.stats.acceptance_rate  # drafted from q1's answer
        sent, kept = again.stats.by_drafter["suffix"]
        assert kept > 0.9 * sent and again.metrics()["speculative_decoding"]["by_drafter"]["suffix"]["accepted_tokens"] == kept
        alone = SpeculativeDecoder(target.model, target.tokenizer, None).generate(
            question, SamplingParams(max_new_tokens=24))
        assert again.token_ids == alone.token_ids
        assert private.text
        assert core.metrics.registry.get_sample_value("onlinespec:suffix_index_tokens", {"draft": next(iter(core.pool.drafts))}) == index.tokens
    finally:
        core.shutdown(drain_seconds=5)
    [saved_file] = (tmp_path / "run" / "drafts").glob(f"*/{SUFFIX_FILE}")
    core = start(tiny_target_folder, tmp_path / "run")
    try:
        assert next(iter(core.pool.drafts.values())).suffix.stats()["requests"] == 2  # loaded again at start-up
        third = core.submit(question, greedy(24), request_id="q3").result()
        index = next(iter(core.pool.drafts.values())).suffix
        assert third.stats.acceptance_rate > 0.9
        core.purge(request_id="q1")
        assert index.stats()["requests"] == 2  # q2, q3
    finally:
        core.shutdown(drain_seconds=5)
    from onlinespec.decoding.proposers.suffix import SuffixIndex

    saved = SuffixIndex()
    saved.load(saved_file)
    assert saved.stats()["requests"] == 2 and saved.counts["purged"] == 1
    from typer.testing import CliRunner

    from onlinespec.cli import app

    done = CliRunner().invoke(app, ["data", "purge", "--out-dir", str(tmp_path / "run"), "--request-id", "q2"])
    assert done.exit_code == 0 and "1 requests from the suffix indices" in done.output
    saved.load(saved_file)
    assert saved.stats()["requests"] == 1  # a stopped server's index is purged too


def test_an_unreadable_index_is_set_aside_and_another_tokenizers_stops_start_up(tiny_target_folder, tmp_path):
    import pytest

    from onlinespec.decoding.proposers.suffix import SuffixIndex
    from onlinespec.serve.handles import LoadFailed

    core = start(tiny_target_folder, tmp_path / "run")
    name = core.submit("x = 1", greedy(4), request_id="a").result().draft
    core.shutdown(drain_seconds=5)
    saved = tmp_path / "run" / "drafts" / name / SUFFIX_FILE
    saved.write_bytes(b"\x00" * 40)  # a torn or foreign file
    core = start(tiny_target_folder, tmp_path / "run")
    try:
        assert core.pool.drafts[name].suffix.stats()["requests"] == 0  # set aside: the index starts empty
        core.submit("x = 1", greedy(4), request_id="b").result()
        assert core.pool.drafts[name].suffix.stats()["requests"] == 1
        assert list((saved.parent / "quarantine").glob(f"{SUFFIX_FILE}.*"))
    finally:
        core.shutdown(drain_seconds=5)
    other = SuffixIndex()
    other.identity = "another tokenizer"
    other.add([1, 2, 3, 4], "elsewhere")
    other.save(saved)
    with pytest.raises(LoadFailed, match="another tokenizer"):
        start(tiny_target_folder, tmp_path / "run")


@pytest.mark.parametrize("shared", [False, True])
def test_a_second_tenant_learns_nothing_from_the_first_tenants_text(tiny_target_folder, tmp_path, shared):
    """Tenant A asks a question twice (the second time drafted from its first answer); tenant B
    then asks it: with tenants separated (the default) B's response body shows no proposal from
    the suffix index, no acceptance beyond what its own text gives, and an answer identical to the
    target alone's; with ``shared_suffix`` B is drafted from A's answer (what separation prevents).
    Without ``speculation_details`` the response does not say which drafter proposed what."""
    question = [{"role": "user", "content": "Explain what a cache is, briefly."}]
    core = start(tiny_target_folder, tmp_path / "run", shared_suffix=shared)
    try:
        core.submit(question, greedy(24), tenant="key-a").result()
        again = core.submit(question, greedy(24), tenant="key-a").result()
        other = core.submit(question, greedy(24), tenant="key-b").result()
    finally:
        core.shutdown()
    suffix_hits = lambda served: served.metrics()["speculative_decoding"]["by_drafter"].get("suffix", {}).get("accepted_tokens", 0)  # noqa: E731
    assert suffix_hits(again) > 0, "the test has power: a tenant's own repeat is drafted from the index"
    assert other.text == again.text
    if shared:
        assert suffix_hits(other) > 0
    else:
        assert suffix_hits(other) == 0 and other.stats.accepted < again.stats.accepted
    details_off = dataclasses.replace(other, details=False).metrics()["speculative_decoding"]
    assert "by_drafter" not in details_off
