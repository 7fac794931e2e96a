"""Two serving replicas and a learner actor on a real local Ray cluster (`onlinespec serve
--replicas 2`), on the tiny random target: records from both replicas reach the one learner, its
publications and an operator's rollback reach both, and killing a replica or the learner mid-work
loses nothing acknowledged and never gives a wrong answer.

The tests share one deployment and run in order (each sends its own requests)."""

from __future__ import annotations

import os
import signal
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import openai
import pytest

from onlinespec.cpu import ENGINE_THREAD, PLUMBING_NICE
from onlinespec.decoding.sampling import SamplingParams
ray = pytest.importorskip("ray", reason="the Ray tests need the [ray] extra: pip install 'onlinespec[ray]'")


@pytest.fixture(scope="module")
def client(deployment) -> openai.OpenAI:
    client = openai.OpenAI(base_url=deployment.url + "/v1", api_key="none", max_retries=0, timeout=60)
    client.model = client.models.list().data[0].id
    return client


MESSAGES = [[{"role": "user", "content": f"Tell me about the number {i} and why it matters."}] for i in range(12)]


def ask(client, messages, max_tokens=16, request_id=None) -> tuple[str, dict]:
    response = client.chat.completions.create(model=client.model, messages=messages, max_tokens=max_tokens, temperature=0,
                                              extra_body={"domain": "chat"}, extra_headers={"X-Request-Id": request_id} if request_id else None)
    return response.choices[0].message.content, response.model_extra["metrics"]


def state(admin) -> dict:
    return admin.get("/admin/drafts").raise_for_status().json()


def chat_row(admin) -> dict:
    return next(d for d in state(admin)["drafts"] if d["name"] == "chat")


def wait_for(condition, seconds: float, what: str):
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        value = condition()
        if value:
            return value
        time.sleep(0.2)
    raise AssertionError(f"not within {seconds:g} s: {what}")


def served_by_both(client, alone, version: str | None = None, tries: int = 12) -> dict[str, list[str]]:
    """Send requests until both replicas answered one; every answer is the target alone's."""
    seen: dict[str, list[str]] = {}
    for i in range(tries):
        messages = MESSAGES[i % len(MESSAGES)]
        with ThreadPoolExecutor(2) as pool:
            answers = list(pool.map(lambda m: ask(client, m), [messages, messages]))
        for text, metrics in answers:
            assert text == alone.generate(messages, SamplingParams(max_new_tokens=16)).text
            seen.setdefault(metrics["replica"], []).extend(metrics["speculative_decoding"]["draft_versions"])
        if len(seen) == 2:
            return seen
    raise AssertionError(f"only replicas {sorted(seen)} answered {2 * tries} requests")


def test_two_replicas_feed_one_learner_and_serve_what_it_publishes(client, admin, alone):
    with ThreadPoolExecutor(4) as pool:
        answers = list(pool.map(lambda i: (i, *ask(client, MESSAGES[i], request_id=f"two-{i}")), range(8)))
    for i, text, _ in answers:
        assert text == alone.generate(MESSAGES[i], SamplingParams(max_new_tokens=16)).text
    assert {m["replica"] for _, _, m in answers} == {"r0", "r1"}
    assert state(admin)["governance"]["records_stored"] >= 8  # every answered request's records, from both replicas

    published = wait_for(lambda: (row := chat_row(admin))["current"] != "v0001" and not row["busy"] and row["current"], 120,
                         "the learner publishing a version")
    # pushed on publication: every replica serves it before it answers another request
    wait_for(lambda: set(chat_row(admin)["replicas"].values()) == {chat_row(admin)["current"]}, 10, "both replicas serving it")
    current = chat_row(admin)["current"]
    assert current >= published
    admin.post("/admin/learning/pause").raise_for_status()  # nothing newer lands while we look
    wait_for(lambda: not chat_row(admin)["busy"], 120, "the update in flight ending")
    current = chat_row(admin)["current"]
    wait_for(lambda: set(chat_row(admin)["replicas"].values()) == {current}, 10, "both replicas serving the newest")
    for replica, versions in served_by_both(client, alone).items():
        assert versions == [current], replica


def threads_of(pid: int) -> dict[str, set[int]]:
    """A process's threads: OS name -> the nice values its threads of that name have."""
    out: dict[str, set[int]] = {}
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            comm = (task / "comm").read_text().strip()
            nice = int((task / "stat").read_text().rsplit(")", 1)[1].split()[16])  # field 19 of stat
        except (OSError, IndexError, ValueError):
            continue
        out.setdefault(comm, set()).add(nice)
    return out


def test_only_the_engines_keep_full_priority(admin, deployment):
    """On a machine that serving fills, every thread that only carries messages (the front's, Ray's
    in a replica) yields to the engines' OpenMP teams (docs/scale.md)."""
    if not Path("/proc/self/task").is_dir():
        pytest.skip("per-thread priorities are read from Linux's /proc")
    base = os.getpriority(os.PRIO_PROCESS, 0)

    def full_priority(pid: int) -> dict:  # threads that compete with the engines (re-lowered every 5 s)
        return {name: nices for name, nices in threads_of(pid).items() if name != ENGINE_THREAD and min(nices) < PLUMBING_NICE}

    for replica in state(admin)["replicas"]:
        assert threads_of(replica["pid"])[ENGINE_THREAD] == {base}, replica["name"]  # the engine thread and its OpenMP team
        wait_for(lambda: not full_priority(replica["pid"]), 12, f"replica {replica['name']}'s plumbing at nice {PLUMBING_NICE}")
    wait_for(lambda: not full_priority(deployment.process.pid), 12, f"the front's threads at nice {PLUMBING_NICE}")


def test_admin_rollback_reaches_both_replicas(client, admin, alone):
    row = chat_row(admin)
    parent = next(v["parent"] for v in row["versions"] if v["version"] == row["current"])
    answer = admin.post("/admin/drafts/chat/rollback").raise_for_status().json()
    assert answer["version"] == parent and answer["replicas"] == {"r0": parent, "r1": parent}
    for replica, versions in served_by_both(client, alone).items():
        assert versions == [parent], replica


def test_a_killed_replica_loses_no_acknowledged_record_and_comes_back_on_the_current_version(client, admin, alone, deployment):
    replicas = {r["name"]: r for r in state(admin)["replicas"]}
    victim = replicas["r0"]["pid"]
    started = []

    def stream(i: int):
        messages = MESSAGES[i]
        try:
            chunks = client.chat.completions.create(model=client.model, messages=messages, max_tokens=200, temperature=0, stream=True,
                                                    extra_body={"domain": "chat"}, extra_headers={"X-Request-Id": f"kill-{i}"})
            text = ""
            for chunk in chunks:
                if chunk.choices and chunk.choices[0].delta.content:
                    started.append(i)
                    text += chunk.choices[0].delta.content
            return i, text, None
        except openai.APIError as err:
            return i, None, err

    with ThreadPoolExecutor(4) as pool:
        futures = [pool.submit(stream, i) for i in range(4)]
        wait_for(lambda: len(set(started)) == 4, 30, "every stream sending text")
        os.kill(victim, signal.SIGKILL)  # mid-request: the streams are still going
        outcomes = [f.result() for f in futures]
    failed = [i for i, text, err in outcomes if err is not None]
    for i, text, err in outcomes:  # an error, or exactly the target alone's answer: never a wrong one
        if err is None:
            assert text == alone.generate(MESSAGES[i], SamplingParams(max_new_tokens=200)).text
    assert failed, "the kill came after every stream had ended: nothing was killed mid-request"

    back = wait_for(lambda: next((r for r in state(admin)["replicas"] if r["name"] == "r0" and r["ready"] and r["pid"] != victim), None),
                    120, "Ray restarting the replica")
    assert back["restarts"] == 1
    current = chat_row(admin)["current"]
    assert back["versions"]["chat"] == current
    for replica, versions in served_by_both(client, alone).items():
        assert versions == [current], replica
    # every acknowledged (answered) request's records are in the learner's buffer
    for i, text, err in outcomes:
        if err is None:
            deleted = admin.post("/admin/data/purge", json={"request_id": f"kill-{i}"}).raise_for_status().json()
            assert deleted["records_deleted"] == 1, i


def test_a_learner_killed_mid_update_publishes_nothing_and_resumes_from_the_registry(client, admin):
    before = chat_row(admin)
    assert not before["busy"]
    admin.post("/admin/drafts/chat/update").raise_for_status()
    wait_for(lambda: chat_row(admin)["busy"], 10, "the update starting")
    os.kill(before["learner_pid"], signal.SIGKILL)

    after = wait_for(lambda: (row := _row_or_none(admin)) and row["learner_pid"] != before["learner_pid"] and row, 120,
                     "Ray restarting the learner")
    assert [v["version"] for v in after["versions"]] == [v["version"] for v in before["versions"]]  # nothing half-written
    assert after["current"] == before["current"] and after["buffer_records"] == before["buffer_records"]
    admin.post("/admin/learning/pause").raise_for_status()
    admin.post("/admin/drafts/chat/update").raise_for_status()
    row = wait_for(lambda: (row := chat_row(admin))["current"] != before["current"] and not row["busy"] and row, 120,
                   "the restarted learner publishing")
    newest = next(v for v in row["versions"] if v["version"] == row["current"])
    update = row["updates"][-1]  # the restarted learner's first update, from the whole buffer
    assert newest["parent"] == before["current"] and update["version"] == row["current"] and update["examples"] >= 1
    wait_for(lambda: set(chat_row(admin)["replicas"].values()) == {row["current"]}, 10, "both replicas serving it")


def _row_or_none(admin) -> dict | None:
    try:
        return chat_row(admin)
    except (httpx.HTTPError, StopIteration):
        return None
