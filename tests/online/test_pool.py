"""Several drafts share one update slot: the update that fell due first runs first, and a stream's
end runs the updates still due."""

import threading

import torch

from onlinespec.decoding.proposers.draft_model import DraftModelProposer
from onlinespec.decoding.sampling import SamplingParams
from onlinespec.decoding.speculative import SpeculativeDecoder
from onlinespec.online.learner import LearnerConfig
from onlinespec.online.pool import DraftPool, PoolConfig
from onlinespec.routing.domains import Router

PARAMS = SamplingParams(max_new_tokens=12, ignore_eos=True)


def test_the_longest_waiting_update_takes_the_free_slot_and_draining_runs_the_rest(tiny_llama, tmp_path):
    target = tiny_llama(seed=0, vocab_size=32, hidden_size=32)
    new_draft = lambda: (DraftModelProposer(tiny_llama(seed=5, vocab_size=32, hidden_size=32)), None)  # noqa: E731
    events = []
    config = LearnerConfig(update_interval=2, steps_per_update=5, batch_size=4, priority="normal", position_policy="verified")
    pool = DraftPool(new_draft, tmp_path, Router("domain"), PoolConfig(config),
                     on_event=lambda e: events.append((e["event"], e["draft"])) if e["event"].startswith("update") else None)
    gen = torch.Generator().manual_seed(0)

    def serve(domain: str) -> None:
        draft = pool.route(domain)
        out = SpeculativeDecoder(target, None, draft.proposer, k=3).generate(torch.randint(0, 32, (6,), generator=gen).tolist(), PARAMS, trace=True)
        pool.observe(draft, out, domain, f"{domain}-{len(events)}")

    release = threading.Event()
    first = pool.route("a").learner
    run_update = first.updater.run
    first.updater.run = lambda *snapshot: (release.wait(60), run_update(*snapshot))  # hold the slot until b and c are due
    for domain in "aabbcc":
        serve(domain)
    assert first.busy and pool.route("b").learner.due and pool.route("c").learner.due
    release.set()
    first.wait()
    serve("c")  # a request of c frees nothing for c: b has waited longer
    pool.wait(drain=True)
    starts = [draft for event, draft in events if event == "update_start"]
    assert starts == ["a", "b", "c"]
    assert not any(learner.due or learner.busy for learner in pool.learners)
    assert [len(learner.reports) for learner in pool.learners] == [1, 1, 1]


def test_a_spawned_draft_starts_from_its_parent_and_its_first_version_says_so(tiny_llama, tmp_path):
    new_draft = lambda: (DraftModelProposer(tiny_llama(seed=5, vocab_size=32, hidden_size=32)), None)  # noqa: E731
    config = LearnerConfig(update_interval=100, priority="normal")
    pool = DraftPool(new_draft, tmp_path, Router("domain"), PoolConfig(config))
    parent = pool.open("code")
    with torch.no_grad():  # the parent learnt something the starting draft does not have
        for p in parent.proposer.model.parameters():
            p.add_(0.5)
    child = pool.drafts["c1-code"] = pool._create("c1-code", start_from=parent)
    meta = child.learner.registry.meta(child.version)
    assert meta["spawned_from"] == {"draft": "code", "version": parent.version} and meta["parent"] is None
    # reloaded from its registry (evicted, or after a restart): the parent's copy, not the starting draft
    again = DraftPool(new_draft, tmp_path, Router("domain"), PoolConfig(config)).open("c1-code")
    for mine, theirs in zip(again.proposer.model.state_dict().values(), parent.proposer.model.state_dict().values()):
        assert torch.equal(mine, theirs)


def test_a_draft_a_merge_retires_while_it_serves_leaves_memory_once_it_is_done(tiny_llama, tmp_path):
    from onlinespec.routing.content import ContentConfig

    new_draft = lambda: (DraftModelProposer(tiny_llama(seed=5, vocab_size=32, hidden_size=32)), None)  # noqa: E731
    pool = DraftPool(new_draft, tmp_path, config=PoolConfig(LearnerConfig(update_interval=100, priority="normal"), content=ContentConfig()))
    try:
        for name in ("c0", "c1"):
            pool.drafts[name] = pool._create(name)
        pool.drafts["c0"].in_flight = 1  # it serves a request when its cluster merges into c1's
        pool.content.router.events.append({"event": "merge", "draft": "c1", "retired": "c0", "merged": 0, "cluster": 1})
        with pool.content.lock:
            pool.content._apply_events()
        assert "c0" in pool.drafts and "c0" in pool.content.retired
        pool.drafts["c0"].in_flight = 0
        pool.tick()
        assert set(pool.drafts) == {"c1"} and "c0" not in pool.content.evicted  # retired, not waiting to come back
    finally:
        pool.close()


def test_a_purge_reaches_a_draft_on_disk_that_is_not_in_memory(tiny_llama, tmp_path):
    """An earlier run's draft that no request has opened yet (or content routing evicted) keeps
    its records on disk: a purge deletes the request's records there too."""
    target = tiny_llama(seed=0, vocab_size=32, hidden_size=32)
    new_draft = lambda: (DraftModelProposer(tiny_llama(seed=5, vocab_size=32, hidden_size=32)), None)  # noqa: E731
    config = LearnerConfig(update_interval=100, priority="normal")
    first = DraftPool(new_draft, tmp_path, Router("domain"), PoolConfig(config))
    for rid, domain in (("gone", "code"), ("kept", "code"), ("other", "chat")):
        draft = first.route(domain)
        out = SpeculativeDecoder(target, None, draft.proposer, k=3).generate([1, 2, 3, 4], PARAMS, trace=True)
        first.observe(draft, out, domain, rid)
    second = DraftPool(new_draft, tmp_path, Router("domain"), PoolConfig(config))  # a restart: nothing opened yet
    assert not second.drafts
    assert second.purge(request_id="gone") == 1 and not second.drafts  # nothing loaded to do it
    assert {r.request_id for r in second.open("code").learner.buffer.records()} == {"kept"}


def test_an_offline_purge_reaches_routing_state_and_every_event_log(tmp_path):
    """`onlinespec data purge` on a stopped server's out-dir: the request leaves the content
    router's saved far prompts and the event logs of the server, its Ray replicas and learners
    (rotated files included), and nothing else goes."""
    import json

    from onlinespec.online.pool import purge_saved
    from onlinespec.routing.content import ContentRouter
    from onlinespec.routing.lifecycle import ROUTING_FILE
    from tests.test_content import domain_embeddings, serve

    draw = domain_embeddings(seed=11)
    router = ContentRouter()
    serve(router, draw, "a" * 40)
    router.assign(draw("b"), request_id="secret")
    (tmp_path / ROUTING_FILE).write_text(json.dumps({"router": router.state(), "evicted": []}))
    logs = [tmp_path / "events.jsonl", tmp_path / "events.1.jsonl", tmp_path / "replicas" / "r0" / "events.jsonl",
            tmp_path / "learners" / "0" / "events.2.jsonl"]
    for log in logs:
        log.parent.mkdir(parents=True, exist_ok=True)
        log.write_text(json.dumps({"event": "request", "id": "secret", "time": 1e9, "text": "my password"}) + "\n"
                       + json.dumps({"event": "request", "id": "other", "time": 1e9}) + "\n")
    gone = purge_saved(tmp_path, request_id="secret")
    assert gone["routing_prompts"] == 1 and gone["event_lines"] == len(logs)
    for path in [tmp_path / ROUTING_FILE, *logs]:
        assert "secret" not in path.read_text() and "my password" not in path.read_text()
    assert all('"other"' in log.read_text() for log in logs)
