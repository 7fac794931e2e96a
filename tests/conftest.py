"""Shared fixtures: tiny random Llama models (fast, CPU) and the real default target (slow)."""

from __future__ import annotations

import os
import shutil
import tempfile

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

# One timed forward per point of a cost curve, not three (onlinespec.factory.CALIBRATION_REPS): the
# suite calibrates every target and batch size it serves with, on an empty cache a third of its
# time, and no test claims a speed. The quick curves are cached under keys of their own.
os.environ.setdefault("ONLINESPEC_CALIBRATION_REPS", "1")


FAST_TMP = "/dev/shm"  # a RAM file system on Linux: an fsync there returns at once


def pytest_configure(config):
    """Temporary folders (``tmp_path``) in RAM where the machine has a RAM file system: the
    code under test makes every record, draft version and registry change durable (fsync the
    file, then its folder: about 3.5 ms a write on this machine's disk, 0.1 ms in RAM), and the
    suite writes thousands; what the tests check (a record kept, a version loadable after a
    SIGKILL) does not depend on the disk. Not with ``--basetemp`` given, and xdist's workers
    inherit the controller's folder.

    Under pytest-xdist (``make test`` runs one worker per core), each worker gets cores of its
    own: its torch threads, its llama.cpp threads (which follow the affinity) and the servers it
    starts stay on them, so two workers never fight over one core (spinning llama.cpp threads
    on a shared core run many times slower) and a test measures what it would alone on a
    machine that size."""
    worker, count = os.environ.get("PYTEST_XDIST_WORKER"), int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    if not worker and config.option.basetemp is None and os.access(FAST_TMP, os.W_OK) and shutil.disk_usage(FAST_TMP).free > 4 * 2**30:
        config.option.basetemp = config._onlinespec_fast_tmp = tempfile.mkdtemp(prefix="onlinespec-tests-", dir=FAST_TMP)
    cores = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []
    if worker and count > 1 and len(cores) >= count:
        mine = cores[int(worker.removeprefix("gw")) % count:: count]
        os.sched_setaffinity(0, mine)
        torch.set_num_threads(len(mine))


@pytest.fixture(autouse=True, scope="session")
def forked_servers():
    """Every server a test starts (``ServerProcess``: the server tests, the demo, the bench
    harness) is forked from this worker's fork server, which imported onlinespec once
    (``tests/forked.py``): about 9 s less per server on a core of this machine's."""
    import forked

    from onlinespec.serve.server import ServerProcess

    patch = pytest.MonkeyPatch()
    patch.setattr(ServerProcess, "launch", staticmethod(forked.launch))
    yield
    patch.undo()


def pytest_unconfigure(config):
    """Give the RAM back: the folder :func:`pytest_configure` made goes with the run."""
    folder = getattr(config, "_onlinespec_fast_tmp", None)
    if folder:
        shutil.rmtree(folder, ignore_errors=True)


# The test files that take longest (docs/testing.md: `make test`'s 20 slowest tests, summed by
# file), longest first. `make test` hands whole files to its workers in collection order
# (--dist loadfile --no-loadscope-reorder), so these start first and the short files fill the
# gaps: a long file drawn last would keep one worker busy while the other idles.
SLOWEST_FILES = [
    # first: it measures the llama.cpp cost curve over batch sizes 1-4 that test_cli's bench and demo
    # (batch 1, on the other worker a minute later) then read from the cache instead of measuring their own
    "tests/decoding/test_llamacpp_backend.py",
    "tests/decoding/test_greedy_identity.py",
    "tests/test_cli.py",
    "tests/serve/test_ray_replicas.py",
    "tests/faults/test_kill_points.py",
    "tests/decoding/test_lossless_engine.py",
    "tests/faults/test_disk_and_files.py",
    "tests/serve/test_server_lifecycle.py",
    "tests/serve/test_hostile_clients.py",
    "tests/decoding/test_processors.py",
    "tests/decoding/test_suffix.py",
    "tests/drafts/test_feature_head.py",
    "tests/decoding/test_edge_cases.py",
]


# The extended tier (`make test-extended`, run by CI after `make test`; docs/testing.md): checks
# that repeat one `make test` makes, on other parameters or another path to the same guarantee,
# and take long. Each line says what in `make test` already covers it.
EXTENDED = {
    # the mixed-batch chi-square test at t=1.0 stays; top-k/top-p warping is checked by the engine's and the head's own at t=1.0 + the verify harness
    "tests/decoding/test_batched_engine.py::test_sampled_output_in_a_mixed_batch_follows_the_targets_distribution[warped]",
    "tests/drafts/test_feature_head.py::test_sampled_output_follows_the_targets_distribution[warped]",
    "tests/decoding/test_lossless_engine.py::test_draft_model_sampling_matches_target_distribution[t0.7-topk4-topp0.9]",
    "tests/decoding/test_lossless_engine.py::test_ngram_sampling_matches_target_distribution[t0.7-topk4-topp0.9]",
    # each processor alone: "top_k -1 and all" (every processor at once) and min_tokens stay, and each one's maths is checked by hand
    *(f"tests/decoding/test_processors.py::test_sampling_follows_the_processed_target[{name}]"
      for name in ("min_p", "repetition_penalty", "presence_penalty", "frequency_penalty", "logit_bias")),
    # the reference sampler's own runs (the engine's verify_sampling stays on both cases)
    "tests/decoding/test_verify.py::test_sampling_follows_target_distribution[reference-V5_k2]",
    "tests/decoding/test_verify.py::test_sampling_follows_target_distribution[reference-V6_k3]",
    # greedy identity on the real target: hybrid (prompt lookup first, then the head, adaptive k) stays, batched on
    # torch, alone and batched on llama.cpp
    "tests/decoding/test_greedy_identity.py::test_greedy_speculative_is_identical[ngram-4-False-1]",
    "tests/decoding/test_greedy_identity.py::test_greedy_speculative_is_identical[head-3-False-1]",
    "tests/decoding/test_greedy_identity.py::test_greedy_speculative_is_identical[target-layers:4-3-False-3]",
    "tests/decoding/test_greedy_identity.py::test_greedy_speculative_is_identical[hybrid-4-True-1]",  # alone; batched stays
    "tests/decoding/test_llamacpp_backend.py::test_greedy_speculative_is_identical_on_llamacpp[ngram-3-False]",
    # bench on torch (the llama.cpp bench test stays)
    "tests/test_cli.py::test_bench_writes_side_by_side_figures[torch]",
    # a kill during an update: the registry's SIGKILL test stays (every version loadable), and the kill-point suite
    "tests/online/test_online_runs.py::test_sigkill_during_an_update_then_restart_serves_the_last_published_version",
    "tests/serve/test_server_lifecycle.py::test_sigterm_during_an_update_publishes_nothing_and_a_restart_serves_the_last_version",
    # (not the Ray fault tests: they share their module's cluster and start from the state the
    # first test of the module leaves, records in the buffer and learning paused)
    # API keys from the environment: the same key loader and check as from a file ([file] stays)
    "tests/serve/test_hostile_clients.py::test_keys_come_from_a_file_or_the_environment_and_are_checked[env]",
    # lm-evaluation-harness against the server (the openai client's loglikelihood-style echo requests stay in test_server_api)
    "tests/serve/test_clients.py::test_lm_eval_loglikelihood_and_generate_until_are_the_target_alones",
}


def pytest_collection_modifyitems(config, items):
    for item in items:
        if item.nodeid in EXTENDED:
            item.add_marker(pytest.mark.extended)
    rank = {path: i for i, path in enumerate(SLOWEST_FILES)}
    items.sort(key=lambda item: rank.get(item.nodeid.split("::")[0], len(rank)))  # stable: file order kept otherwise

def build_tiny_llama(
    seed: int,
    vocab_size: int = 6,
    hidden_size: int = 16,
    num_layers: int = 1,
    head_scale: float = 10.0,
    eos_token_id: int | None = None,
) -> LlamaForCausalLM:
    """A random 1-layer Llama whose output head is scaled up so its distributions are peaked.

    ``eos_token_id=None`` means the model has no EOS at all (generation only stops on length).
    """
    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        num_hidden_layers=num_layers,
        num_attention_heads=2,
        num_key_value_heads=2,
        intermediate_size=32,
        max_position_embeddings=256,
        bos_token_id=None,
        eos_token_id=eos_token_id,
        pad_token_id=None,
        tie_word_embeddings=False,
    )
    model = LlamaForCausalLM(config).eval().requires_grad_(False)
    with torch.no_grad():
        model.lm_head.weight.mul_(head_scale)
    model.generation_config.eos_token_id = eos_token_id
    return model


@pytest.fixture(scope="session")
def tiny_llama():
    """Factory: ``tiny_llama(seed, **kwargs)`` builds a fresh tiny random Llama (see build_tiny_llama)."""
    return build_tiny_llama


@pytest.fixture(scope="session")
def tiny_target() -> LlamaForCausalLM:
    """Vocabulary 6, no EOS. Shared: tests must not modify it."""
    return build_tiny_llama(seed=0)


@pytest.fixture(scope="session")
def tiny_draft() -> LlamaForCausalLM:
    """Same shape as ``tiny_target`` with other random weights, so its distributions differ."""
    return build_tiny_llama(seed=1)


@pytest.fixture(scope="session")
def default_tokenizer():
    """The default target's real tokenizer (vocabulary 49152); converts the default model on first use."""
    from transformers import AutoTokenizer

    from onlinespec.models import default_target_dir

    return AutoTokenizer.from_pretrained(str(default_target_dir()))


@pytest.fixture(scope="session")
def tiny_target_folder(tmp_path_factory, default_tokenizer):
    """A tiny random 2-layer Llama with the default tokenizer, saved as a Hugging Face folder
    (a target spec the CLI and the online runner load like any local model)."""
    folder = tmp_path_factory.mktemp("tiny-target-2l")
    model = build_tiny_llama(11, vocab_size=len(default_tokenizer), hidden_size=16, num_layers=2, head_scale=3.0)
    model.generation_config.eos_token_id = default_tokenizer.eos_token_id
    model.save_pretrained(folder)
    default_tokenizer.save_pretrained(folder)
    return folder


@pytest.fixture(scope="session")
def default_target():
    """The real default target (SmolLM2-135M-Instruct), loaded once per session. Slow tests only."""
    from onlinespec.models import load_model

    return load_model("default")


def chi_square_pvalue(counts, probs, min_expected: float = 5.0) -> tuple[float, float, int]:
    """Pearson chi-square goodness of fit of ``counts`` to ``probs``: ``(p_value, statistic, df)``.

    Bins whose expected count is below ``min_expected`` are pooled into one bin (grown with the next
    smallest bins until it reaches ``min_expected``). A count in a bin of probability exactly 0 is
    an impossible outcome: the p-value is then 0. The p-value is the upper regularized incomplete
    gamma function Q(df/2, stat/2), computed with torch (no scipy).
    """
    counts = torch.as_tensor(counts, dtype=torch.float64).flatten()
    probs = torch.as_tensor(probs, dtype=torch.float64).flatten()
    assert counts.shape == probs.shape
    probs = probs / probs.sum()
    if counts[probs == 0].sum() > 0:
        return 0.0, float("inf"), 0
    counts, probs = counts[probs > 0], probs[probs > 0]
    n = counts.sum()
    expected = probs * n
    order = torch.argsort(expected)
    expected, counts = expected[order], counts[order]
    # pool the smallest bins until the pooled bin is large enough
    cut = int((expected < min_expected).sum())
    while cut and cut < len(expected) and expected[:cut].sum() < min_expected:
        cut += 1
    if cut > 1:
        expected = torch.cat([expected[:cut].sum().reshape(1), expected[cut:]])
        counts = torch.cat([counts[:cut].sum().reshape(1), counts[cut:]])
    df = len(expected) - 1
    if df < 1:
        return 1.0, 0.0, 0
    stat = float(((counts - expected) ** 2 / expected).sum())
    p = float(torch.special.gammaincc(torch.tensor(df / 2, dtype=torch.float64), torch.tensor(stat / 2, dtype=torch.float64)))
    return p, stat, df


@pytest.fixture(scope="session")
def chi_square():
    """The :func:`chi_square_pvalue` helper, as a fixture so any test module can use it."""
    return chi_square_pvalue


@pytest.fixture
def one_thread():
    """Run tiny-model decoding on one CPU thread: with tiny matrices extra threads only add
    synchronization, and on a busy 2-core machine they make each step many times slower."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
