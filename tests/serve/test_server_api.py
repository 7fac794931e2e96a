"""The OpenAI API of a real server: what a client gets equals what `generate()` gives, with the
usage and speculation figures right, streaming or not, with several clients at once."""

from __future__ import annotations

import json
import re
import time
from concurrent.futures import ThreadPoolExecutor
from datetime import datetime

import httpx
import pytest
import torch
from prometheus_client.parser import text_string_to_metric_families

from onlinespec.decoding.sampling import SamplingParams

MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name three primes."}]


def check_figures(body: dict, completion_tokens: int) -> dict:
    spec = body["metrics"]["speculative_decoding"]
    assert spec["num_drafts"] == sum(spec["acceptance_histogram"])
    assert spec["num_accepted_tokens"] == sum(spec["num_accepted_tokens_per_pos"])
    assert spec["num_accepted_tokens"] == sum(n * count for n, count in enumerate(spec["acceptance_histogram"]))
    assert 0 <= spec["num_accepted_tokens"] <= spec["num_judged_tokens"] <= spec["num_draft_tokens"]
    if spec["num_drafts"]:
        assert spec["mean_acceptance_length"] == pytest.approx(1 + spec["num_accepted_tokens"] / spec["num_drafts"])
    # every emitted token is an accepted proposal or the target's own, one per target forward
    assert spec["num_accepted_tokens"] <= completion_tokens
    assert spec["draft"] and spec["draft_version"].startswith("v")
    return spec


def test_chat_and_completions_equal_generate_streaming_or_not(client, model, alone):
    params = SamplingParams(max_new_tokens=24)
    for messages in (MESSAGES, [{"role": "user", "content": "def add(a, b):"}]):
        want = alone.generate(messages, params)
        got = client.chat.completions.create(model=model, messages=messages, max_tokens=24, temperature=0)
        assert got.choices[0].message.content == want.text
        assert got.choices[0].finish_reason == ("length" if want.stats.finish_reason == "length" else "stop")
        assert (got.usage.prompt_tokens, got.usage.completion_tokens) == (len(want.prompt_ids), len(want.token_ids))
        assert got.usage.total_tokens == got.usage.prompt_tokens + got.usage.completion_tokens
        check_figures(got.model_dump(), got.usage.completion_tokens)

        chunks = list(client.chat.completions.create(model=model, messages=messages, max_tokens=24, temperature=0, stream=True,
                                                     stream_options={"include_usage": True}))
        assert chunks[0].choices[0].delta.role == "assistant"
        assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == want.text
        assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == len(want.token_ids)
        last = [c for c in chunks if c.choices][-1]
        assert last.choices[0].finish_reason is not None
        check_figures(last.model_dump(), len(want.token_ids))

    prompt = "The capital of France is"
    want = alone.generate(prompt, SamplingParams(max_new_tokens=20))
    got = client.completions.create(model=model, prompt=prompt, max_tokens=20, temperature=0)
    assert got.choices[0].text == want.text and got.usage.completion_tokens == len(want.token_ids)
    streamed = list(client.completions.create(model=model, prompt=prompt, max_tokens=20, temperature=0, stream=True))
    assert "".join(c.choices[0].text for c in streamed) == want.text


def test_min_tokens_past_128_within_a_larger_budget_is_served(client, model):
    """min_tokens above SamplingParams' library default budget (128): served, at least min_tokens
    long and within max_tokens (it was a 500: the budget was a placeholder of 128 until admission)."""
    got = client.completions.create(model=model, prompt="Hi", max_tokens=160, temperature=0, extra_body={"min_tokens": 140})
    assert 140 <= got.usage.completion_tokens <= 160
    chat = client.chat.completions.create(model=model, messages=[{"role": "user", "content": "Hi"}], max_completion_tokens=150,
                                          temperature=0, extra_body={"min_tokens": 140})
    assert 140 <= chat.usage.completion_tokens <= 150


def test_stop_strings_and_request_ids(client, model, alone, server):
    prompt = "Once upon a time"
    full = alone.generate(prompt, SamplingParams(max_new_tokens=30)).text
    stop = full.split()[3]  # a word from the middle of the answer
    want = alone.generate(prompt, SamplingParams(max_new_tokens=30, stop_strings=(stop,)))
    got = client.completions.create(model=model, prompt=prompt, max_tokens=30, temperature=0, stop=[stop])
    assert got.choices[0].text == want.text and stop not in got.choices[0].text and got.choices[0].finish_reason == "stop"
    streamed = "".join(c.choices[0].text for c in client.completions.create(model=model, prompt=prompt, max_tokens=30,
                                                                            temperature=0, stop=stop, stream=True))
    assert streamed == want.text  # a stop string never leaks half-formed into a stream
    response = httpx.post(server.url + "/v1/completions", headers={"X-Request-Id": "my-request-7"},
                          json={"model": model, "prompt": prompt, "max_tokens": 4})
    assert response.status_code == 200 and response.headers["x-request-id"] == "my-request-7"


def test_concurrent_clients_each_get_the_target_alones_text(client, model, alone):
    prompts = [f"Item {i}: the {w} of" for i, w in enumerate(["colour", "weight", "price", "shape", "size", "age", "name", "taste"])]
    lengths = [8, 30, 12, 40, 5, 25, 18, 33]  # different lengths: requests join and leave the batch mid-flight

    def ask(i: int) -> str:
        return client.completions.create(model=model, prompt=prompts[i], max_tokens=lengths[i], temperature=0).choices[0].text

    with ThreadPoolExecutor(8) as pool:
        got = list(pool.map(ask, range(8)))
    assert got == [alone.generate(p, SamplingParams(max_new_tokens=n)).text for p, n in zip(prompts, lengths)]


def test_logprobs_echo_choices_and_processors_are_the_target_alones(client, model, alone):
    """What lm-eval and best-of clients read: each log probability the target alone gives (1e-4),
    the prompt's with echo, ``n`` choices and several prompts in one request, and vLLM's
    processors giving the processed target alone's greedy text."""
    want = alone.generate(MESSAGES, SamplingParams(max_new_tokens=12, logprobs=3))
    got = client.chat.completions.create(model=model, messages=MESSAGES, max_tokens=12, temperature=0, logprobs=True, top_logprobs=3)
    content = got.choices[0].logprobs.content
    assert [c.logprob for c in content] == pytest.approx([x.logprob for x in want.logprobs], abs=1e-4)
    assert [c.token for c in content] == [alone.tokenizer.decode([x.token]) for x in want.logprobs]
    assert all(len(c.top_logprobs) == 3 and c.top_logprobs[0].logprob >= c.logprob - 1e-6 for c in content)
    streamed = [c for c in client.chat.completions.create(model=model, messages=MESSAGES, max_tokens=12, temperature=0, logprobs=True,
                                                          stream=True) if c.choices and c.choices[0].logprobs]
    assert [x.logprob for c in streamed for x in c.choices[0].logprobs.content] == pytest.approx([x.logprob for x in want.logprobs], abs=1e-4)

    ids = alone.encode("The capital of France is")  # lm-eval's loglikelihood call: token ids, echo, one new token
    got = client.completions.create(model=model, prompt=ids, max_tokens=1, temperature=0, logprobs=1, echo=True).choices[0]
    with torch.inference_mode():
        forward = alone.target(input_ids=torch.tensor([ids])).logits[0].float().log_softmax(-1)
    assert got.logprobs.token_logprobs[0] is None and len(got.logprobs.tokens) == len(ids) + 1
    assert got.logprobs.token_logprobs[1: len(ids)] == pytest.approx([float(forward[i, t]) for i, t in enumerate(ids[1:])], abs=1e-4)
    assert got.logprobs.token_logprobs[-1] == pytest.approx(float(forward[-1].max()), abs=1e-4)
    assert got.text == alone.tokenizer.decode(ids) + alone.generate(ids, SamplingParams(max_new_tokens=1)).text

    # a seeded text depends on its seed and its draft: a domain of their own, not trained, so no update comes between them
    pinned = {"train": False, "domain": "seeded-choices"}
    three = client.completions.create(model=model, prompt=["Roses are", "Violets are"], max_tokens=8, temperature=0.9, seed=5, n=3,
                                      extra_body=pinned)
    assert [c.index for c in three.choices] == list(range(6)) and three.usage.prompt_tokens == len(alone.encode("Roses are")) + len(alone.encode("Violets are"))
    again = client.completions.create(model=model, prompt=["Roses are", "Violets are"], max_tokens=8, temperature=0.9, seed=5, n=3,
                                      extra_body=pinned)
    assert [c.text for c in again.choices] == [c.text for c in three.choices]
    assert len({c.text for c in three.choices[:3]}) > 1  # each choice its own draw

    processed = dict(repetition_penalty=1.5, frequency_penalty=0.4, min_tokens=6, logit_bias={"13": 3.0})
    want = alone.generate("Count: one, two,", SamplingParams(max_new_tokens=16, repetition_penalty=1.5, frequency_penalty=0.4,
                                                             min_tokens=6, logit_bias=((13, 3.0),)))
    got = client.completions.create(model=model, prompt="Count: one, two,", max_tokens=16, temperature=0, extra_body=processed)
    assert got.choices[0].text == want.text and want.text != alone.generate("Count: one, two,", SamplingParams(max_new_tokens=16)).text


def test_a_seeded_sampled_request_is_reproducible_and_train_false_is_never_stored(client, model, server):
    ask = lambda seed: client.completions.create(  # noqa: E731
        model=model, prompt="Roses are", max_tokens=16, temperature=0.9, top_p=0.95, seed=seed,
        extra_body={"train": False, "domain": "poetry"}).choices[0].text
    assert ask(3) == ask(3)
    from onlinespec.online.buffer import ReplayBuffer

    folder = server.out_dir / "buffer" / "poetry"
    assert not folder.exists() or len(ReplayBuffer(folder)) == 0


def test_served_sampling_follows_the_target_distribution(server, model, alone):
    """First tokens of 400 seeded requests (temperature 1, top_k 5: the tiny target's distribution
    is flat over its whole vocabulary) against the target's own sampling distribution:
    chi-square over the 5 tokens, 4 degrees of freedom; fails below p = 0.001. Seeds 0..399."""
    from onlinespec.decoding.sampling import logits_to_probs

    prompt, n = "A", 400
    with torch.no_grad():
        logits = alone.target(torch.tensor([alone.encode(prompt)])).logits[0, -1].float()
    probs = logits_to_probs(logits, SamplingParams(temperature=1.0, top_k=5))
    top = probs.topk(5).indices.tolist()
    words = [alone.tokenizer.decode([t], skip_special_tokens=True) for t in top]
    assert len(set(words)) == 5

    def first(seed: int) -> str:
        body = httpx.post(server.url + "/v1/completions", json={"model": model, "prompt": prompt, "max_tokens": 1, "temperature": 1.0,
                                                                "top_k": 5, "seed": seed, "train": False}, timeout=30).json()
        return body["choices"][0]["text"]

    with ThreadPoolExecutor(4) as pool:
        texts = list(pool.map(first, range(n)))
    counts = [texts.count(w) for w in words]
    assert sum(counts) == n
    expected = [n * probs[t].item() for t in top]
    statistic = sum((c - e) ** 2 / e for c, e in zip(counts, expected))
    assert statistic < 18.47, (counts, [round(e, 1) for e in expected])


def test_metrics_parse_and_agree_with_the_responses(server, model):
    def counters() -> dict:
        text = httpx.get(server.url + "/metrics").text
        out = {}
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                if sample.name.endswith("_total") and sample.labels.get("domain") == "metrics-test":
                    out[sample.name] = out.get(sample.name, 0) + sample.value
        return out

    before = counters()
    sent = {"drafts": 0, "draft_tokens": 0, "accepted": 0, "tokens": 0}
    for i in range(5):
        body = httpx.post(server.url + "/v1/completions", json={"model": model, "prompt": f"Count to {i}:", "max_tokens": 12,
                                                                "temperature": 0, "domain": "metrics-test"}).json()
        spec = body["metrics"]["speculative_decoding"]
        sent["drafts"] += spec["num_drafts"]
        sent["draft_tokens"] += spec["num_draft_tokens"]
        sent["accepted"] += spec["num_accepted_tokens"]
        sent["tokens"] += body["usage"]["completion_tokens"]
    after = counters()
    delta = lambda name: after.get(f"onlinespec:{name}_total", 0) - before.get(f"onlinespec:{name}_total", 0)  # noqa: E731
    assert delta("spec_decode_num_drafts") == sent["drafts"]
    assert delta("spec_decode_num_draft_tokens") == sent["draft_tokens"]
    assert delta("spec_decode_num_accepted_tokens") == sent["accepted"] == delta("spec_decode_num_accepted_tokens_per_pos")
    assert delta("generation_tokens") == sent["tokens"]
    names = {f.name for f in text_string_to_metric_families(httpx.get(server.url + "/metrics").text)}
    assert {"onlinespec:e2e_request_latency_seconds", "onlinespec:time_to_first_token_seconds",
            "onlinespec:inter_token_latency_seconds", "onlinespec:num_requests_running", "onlinespec:num_requests_waiting",
            "onlinespec:draft_version_info", "onlinespec:buffer_records", "onlinespec:scheduler_preemptions",
            "onlinespec:held_rows_sat_out_steps"} <= names  # counters' family names drop _total


def test_the_admin_api_lists_pauses_updates_rolls_back_and_pins(server, model):
    admin = httpx.Client(base_url=server.url, headers={"Authorization": "Bearer admin-secret"}, timeout=60)
    for i in range(4):  # the draft of domain "admin-test" exists once it served a request
        httpx.post(server.url + "/v1/completions", json={"model": model, "prompt": f"x{i} =", "max_tokens": 6,
                                                         "temperature": 0, "domain": "admin-test"}).raise_for_status()
    wait_idle(admin)
    draft = {d["name"]: d for d in admin.get("/admin/drafts").json()["drafts"]}["admin-test"]
    assert draft["learning"] and draft["current"] in [v["version"] for v in draft["versions"]]
    assert admin.post("/admin/learning/pause").json()["paused"] is True
    assert admin.post("/admin/learning/resume").json()["paused"] is False
    wait_idle(admin)  # resuming starts the update that waited longest (another draft's, maybe): let it end
    started = admin.post("/admin/drafts/admin-test/update").json()
    assert started.get("started") is True, started
    wait_idle(admin)
    versions = [v["version"] for v in {d["name"]: d for d in admin.get("/admin/drafts").json()["drafts"]}["admin-test"]["versions"]]
    assert len(versions) >= 2  # the starting draft and at least one published update (the gate passes on this model)
    rolled = admin.post("/admin/drafts/admin-test/rollback").json()["version"]
    assert rolled == admin.get("/admin/drafts").json()["drafts"][0]["current"] or rolled in versions
    pinned = admin.post("/admin/drafts/admin-test/pin", json={"version": versions[0]}).json()
    assert pinned == {"draft": "admin-test", "version": versions[0], "pinned": True}
    for i in range(4):  # learning goes on, but nothing is published while pinned
        httpx.post(server.url + "/v1/completions", json={"model": model, "prompt": f"y{i} =", "max_tokens": 6,
                                                         "temperature": 0, "domain": "admin-test"}).raise_for_status()
    admin.post("/admin/drafts/admin-test/update")
    wait_idle(admin)
    state = {d["name"]: d for d in admin.get("/admin/drafts").json()["drafts"]}["admin-test"]
    assert state["current"] == versions[0] and state["pinned"] and state["updates"][-1]["outcome"] in ("pinned", "refused")
    served = httpx.post(server.url + "/v1/completions", json={"model": model, "prompt": "z =", "max_tokens": 4, "temperature": 0,
                                                              "domain": "admin-test"}).json()
    assert served["metrics"]["speculative_decoding"]["draft_version"] == versions[0]
    assert admin.post("/admin/drafts/admin-test/pin", json={"version": None}).json()["pinned"] is False


def wait_idle(admin: httpx.Client, timeout: float = 60) -> None:
    import time

    deadline = time.monotonic() + timeout
    while any(d.get("busy") for d in admin.get("/admin/drafts").json()["drafts"]):
        assert time.monotonic() < deadline, "an update ran past the test's limit"
        time.sleep(0.1)


def test_a_client_that_disconnects_mid_stream_frees_its_slot(server, model):
    with httpx.stream("POST", server.url + "/v1/completions", timeout=30,
                      json={"model": model, "prompt": "Tell a long story:", "max_tokens": 200, "temperature": 0,
                            "stream": True, "ignore_eos": True, "domain": "disconnect-test"}) as response:
        for line in response.iter_lines():
            if line.startswith("data: {"):
                break  # one chunk, then hang up
    events = server.out_dir / "events.jsonl"
    import time

    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        logged = [json.loads(line) for line in events.read_text().splitlines()]
        cancelled = [e for e in logged if e["event"] == "cancelled" and e["draft"] == "disconnect-test"]
        if cancelled:
            break
        time.sleep(0.05)
    assert cancelled and cancelled[0]["new_tokens"] < 200  # dropped before its end, not served to the end
    assert not any(e["event"] == "request" and e["draft"] == "disconnect-test" for e in logged)  # nothing recorded
    running = [s.value for f in text_string_to_metric_families(httpx.get(server.url + "/metrics").text)
               if f.name == "onlinespec:num_requests_running" for s in f.samples]
    assert running == [0.0]


def test_request_logs_hold_no_text(server, model):
    """Log lines are JSON objects with a timestamp and a level: a request line with its figures, an
    access line per HTTP request but not per successful health probe; never the prompt, the output
    or an Authorization header."""
    secret, key = "zebra-quartz-7731", "sk-never-logged-4417"
    httpx.get(server.url + "/ready", headers={"X-Request-Id": "probe-req-1"}).raise_for_status()
    httpx.post(server.url + "/v1/completions", json={"model": model, "prompt": f"The password is {secret}.", "max_tokens": 4},
               headers={"Authorization": f"Bearer {key}", "X-Request-Id": "logged-req-1"}).raise_for_status()
    time.sleep(0.2)  # the access line is written once the response has gone
    log = (server.out_dir.parent / "run.log").read_text()
    lines = [line for line in map(json.loads, (text for text in log.splitlines() if text.startswith("{"))) if "logger" in line]
    requests = [line for line in lines if line.get("event") == "request"]
    assert requests and {"id", "domain", "draft", "draft_version", "completion_tokens", "alpha", "seconds"} <= set(requests[-1])
    access = [line for line in lines if line["logger"] == "onlinespec.access" and line.get("request_id") == "logged-req-1"]
    assert len(access) == 1 and access[0]["method"] == "POST" and access[0]["path"] == "/v1/completions" and access[0]["status"] == 200
    assert access[0]["level"] == "INFO" and access[0]["duration_seconds"] > 0
    assert not [line for line in lines if line.get("request_id") == "probe-req-1"]  # a probe logs at DEBUG
    assert all(datetime.fromisoformat(line["ts"]).tzinfo for line in lines)
    assert secret not in log and key not in log and secret not in (server.out_dir / "events.jsonl").read_text()


def test_health_ready_models(server, model):
    assert httpx.get(server.url + "/health").json()["status"] == "alive"
    ready = httpx.get(server.url + "/ready")
    assert ready.status_code == 200 and ready.json()["model"] == model
    models = httpx.get(server.url + "/v1/models").json()
    assert models["object"] == "list" and models["data"][0]["id"] == model


def test_training_data_can_be_purged_by_request_and_governance_says_what_was_kept(server, model):
    from onlinespec.online.buffer import ReplayBuffer

    admin = httpx.Client(base_url=server.url, headers={"Authorization": "Bearer admin-secret"}, timeout=60)
    for rid, train in (("purge-me", True), ("keep-me", True), ("opted-out", False)):
        httpx.post(server.url + "/v1/completions", headers={"X-Request-Id": rid},
                   json={"model": model, "prompt": f"{rid} =", "max_tokens": 6, "temperature": 0, "domain": "purge-test",
                         "train": train}).raise_for_status()
    wait_idle(admin)
    before = admin.get("/admin/drafts").json()["governance"]
    assert before["refused_opt_out"] >= 1 and before["records_stored"] >= 2
    done = admin.post("/admin/data/purge", json={"request_id": "purge-me"}).raise_for_status().json()
    assert done["records_deleted"] >= 1 and done["governance"]["purged"] >= before["purged"] + 1
    held = {r.request_id.split("#")[0] for r in ReplayBuffer(server.out_dir / "buffer" / "purge-test").records()}
    assert "purge-me" not in held and "keep-me" in held and "opted-out" not in held
    bad = admin.post("/admin/data/purge", json={"request_id": 3})
    assert bad.status_code == 400 and "request_id" in bad.json()["error"]["message"]
    assert "onlinespec:requests_opted_out_total" in httpx.get(server.url + "/metrics").text


# PromQL of vLLM's Grafana dashboard (examples/online_serving/prometheus_grafana/grafana.json) and
# the spec-decode panels of its docs: every series they read must be on /metrics, with model_name.
VLLM_DASHBOARD = [
    'histogram_quantile(0.99, sum by(le) (rate(vllm:e2e_request_latency_seconds_bucket{model_name="$model_name"}[$__rate_interval])))',
    'rate(vllm:e2e_request_latency_seconds_sum{model_name="$model_name"}[$__rate_interval])\n/\nrate(vllm:e2e_request_latency_seconds_count{model_name="$model_name"}[$__rate_interval])',
    'rate(vllm:prompt_tokens_total{model_name="$model_name"}[$__rate_interval])',
    'rate(vllm:generation_tokens_total{model_name="$model_name"}[$__rate_interval])',
    'histogram_quantile(0.99, sum by(le) (rate(vllm:time_per_output_token_seconds_bucket{model_name="$model_name"}[$__rate_interval])))',
    'rate(vllm:time_per_output_token_seconds_sum{model_name="$model_name"}[$__rate_interval])\n/\nrate(vllm:time_per_output_token_seconds_count{model_name="$model_name"}[$__rate_interval])',
    'vllm:num_requests_running{model_name="$model_name"}',
    'vllm:num_requests_waiting{model_name="$model_name"}',
    'histogram_quantile(0.99, sum by(le) (rate(vllm:time_to_first_token_seconds_bucket{model_name="$model_name"}[$__rate_interval])))',
    'rate(vllm:time_to_first_token_seconds_sum{model_name="$model_name"}[$__rate_interval])\n/\nrate(vllm:time_to_first_token_seconds_count{model_name="$model_name"}[$__rate_interval])',
    'vllm:gpu_cache_usage_perc{model_name="$model_name"}',
    'vllm:kv_cache_usage_perc{model_name="$model_name"}',
    'sum by(le) (increase(vllm:request_prompt_tokens_bucket{model_name="$model_name"}[$__rate_interval]))',
    'sum by(le) (increase(vllm:request_generation_tokens_bucket{model_name="$model_name"}[$__rate_interval]))',
    'sum by(finished_reason) (increase(vllm:request_success_total{model_name="$model_name"}[$__rate_interval]))',
    'rate(vllm:request_queue_time_seconds_sum{model_name="$model_name"}[$__rate_interval])',
    'rate(vllm:request_prefill_time_seconds_sum{model_name="$model_name"}[$__rate_interval])',
    'rate(vllm:request_decode_time_seconds_sum{model_name="$model_name"}[$__rate_interval])',
    'rate(vllm:request_max_num_generation_tokens_sum{model_name="$model_name"}[$__rate_interval])',
    'histogram_quantile(0.99, sum by(le) (rate(vllm:inter_token_latency_seconds_bucket{model_name="$model_name"}[$__rate_interval])))',
    ('rate(vllm:spec_decode_num_accepted_tokens_total{model_name="$model_name"}[$__rate_interval]) / '
     'rate(vllm:spec_decode_num_draft_tokens_total{model_name="$model_name"}[$__rate_interval])'),
    'rate(vllm:spec_decode_num_drafts_total{model_name="$model_name"}[$__rate_interval])',
    'sum by(position) (rate(vllm:spec_decode_num_accepted_tokens_per_pos_total{model_name="$model_name"}[$__rate_interval]))',
]


def test_vllms_dashboard_finds_its_series_with_the_served_model_name(server, model):
    for i in range(2):
        httpx.post(server.url + "/v1/chat/completions", json={"model": model, "messages": MESSAGES, "max_tokens": 12 + i,
                                                              "temperature": 0}, timeout=60).raise_for_status()
    samples: dict[str, list] = {}
    for family in text_string_to_metric_families(httpx.get(server.url + "/metrics").text):
        for sample in family.samples:
            samples.setdefault(sample.name, []).append(sample)
    names = {name for expr in VLLM_DASHBOARD for name in re.findall(r"vllm:[a-z0-9_]+", expr)}
    assert len(names) >= 20
    for name in sorted(names):
        assert name in samples, f"{name} is not on /metrics"
        assert all(s.labels["model_name"] == model for s in samples[name]), name
    total = lambda name: sum(s.value for s in samples[name])  # noqa: E731
    for name in ("vllm:prompt_tokens_total", "vllm:generation_tokens_total", "vllm:request_success_total",
                 "vllm:e2e_request_latency_seconds_count", "vllm:time_to_first_token_seconds_count",
                 "vllm:time_per_output_token_seconds_count", "vllm:request_prompt_tokens_count", "vllm:request_params_max_tokens_count",
                 "vllm:spec_decode_num_drafts_total", "vllm:spec_decode_num_draft_tokens_total", "vllm:inter_token_latency_seconds_count"):
        assert total(name) > 0, name
    assert total("vllm:prompt_tokens_total") == total("onlinespec:prompt_tokens_total")  # one recording call feeds both
    # ours per draft version keep the newest versions only (KEEP_VERSIONS); vLLM's count from the start
    assert total("vllm:spec_decode_num_accepted_tokens_total") >= total("onlinespec:spec_decode_num_accepted_tokens_total") > 0
    assert 0 <= total("vllm:kv_cache_usage_perc") <= 1 and {s.labels["finished_reason"] for s in samples["vllm:request_success_total"]} <= {"stop", "length"}


def test_tokenize_detokenize_version_and_every_served_name(server, model, alone):
    ALIAS = "alias-model"  # the shared server's second --served-model-name (conftest.py)
    post = lambda path, body: httpx.post(server.url + path, json=body, timeout=60)  # noqa: E731
    text = "The capital of France is"
    got = post("/tokenize", {"model": model, "prompt": text}).json()
    served = post("/v1/completions", {"model": ALIAS, "prompt": text, "max_tokens": 1}).json()
    assert got["tokens"] == alone.tokenizer(text).input_ids and got["count"] == served["usage"]["prompt_tokens"]
    assert served["model"] == model  # a request may name any served name: the first is reported
    assert got["max_model_len"] == httpx.get(server.url + "/v1/models").json()["data"][0]["max_model_len"] > 0
    chat = post("/tokenize", {"messages": MESSAGES, "return_token_strs": True}).json()
    answered = post("/v1/chat/completions", {"model": model, "messages": MESSAGES, "max_tokens": 1}).json()
    assert chat["count"] == answered["usage"]["prompt_tokens"] == len(chat["token_strs"])
    assert post("/detokenize", {"model": model, "tokens": got["tokens"]}).json()["prompt"] == alone.tokenizer.decode(got["tokens"])
    assert httpx.get(server.url + "/version").json()["version"]
    assert [m["id"] for m in httpx.get(server.url + "/v1/models").json()["data"]] == [model, ALIAS]
    for path, body, status, param in (("/tokenize", {"model": model}, 400, "prompt"),
                                      ("/tokenize", {"prompt": "a", "messages": MESSAGES}, 400, "messages"),
                                      ("/tokenize", {"prompt": 3}, 422, "prompt"),
                                      ("/tokenize", {"prompt": "a", "model": "other"}, 404, "model"),
                                      ("/tokenize", {"prompt": "a", "add_special_token": True}, 422, "add_special_token"),
                                      ("/detokenize", {"tokens": [1, 10 ** 9]}, 400, "tokens.1"),
                                      ("/detokenize", {"tokens": "abc"}, 422, "tokens")):
        error = post(path, body)
        assert error.status_code == status and error.json()["error"]["param"] == param, (path, body, error.text)
