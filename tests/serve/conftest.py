"""Real `onlinespec serve` processes on 127.0.0.1, on the tiny random target (mechanics only:
acceptance and speed claims use the real model, in bench/)."""

from __future__ import annotations

import os

import openai
import pytest

from onlinespec.serve.server import ServerProcess

ADMIN = "admin-secret"
ALIAS = "alias-model"  # the shared server's second served model name


def server_args(target, out_dir, *extra: str) -> list[str]:
    return ["--target", str(target), "--draft", "target-layers:1", "-k", "2", "--no-kernels", "--fixed-k",
            "--out-dir", str(out_dir), "--admin-key", ADMIN, "--update-interval", "3", "--steps-per-update", "2",
            "--batch-size", "4", "--priority", "normal", *extra]


def start_server(target, out_dir, *extra: str, log=None) -> ServerProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return ServerProcess(server_args(target, out_dir, *extra), log=log or out_dir.parent / f"{out_dir.name}.log", env=env,
                         ready_timeout=180).start()


@pytest.fixture(scope="module")
def server(tiny_target_folder, tmp_path_factory):
    """One learning server shared by a module's tests (each test sends its own requests)."""
    out_dir = tmp_path_factory.mktemp("served") / "run"
    process = start_server(tiny_target_folder, out_dir, "--max-waiting", "64", "--max-body-bytes", "20000",
                           "--served-model-name", f"{tiny_target_folder.name},{ALIAS}")  # vLLM's several names: the first is reported
    process.out_dir = out_dir
    yield process
    assert process.stop() == 0


@pytest.fixture(scope="session")
def alone(tiny_target_folder):
    """The target alone, in this process: the reference every served greedy answer must equal."""
    from onlinespec.decoding.speculative import SpeculativeDecoder
    from onlinespec.models import load_model

    target = load_model(str(tiny_target_folder))
    return SpeculativeDecoder(target.model, target.tokenizer, None)


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def model(client) -> str:
    return client.models.list().data[0].id


@pytest.fixture
def launch(tiny_target_folder):
    """``launch(out_dir, *extra_args)`` starts a server of its own (stopped at the test's end if still up)."""
    started = []

    def start(out_dir, *extra: str) -> ServerProcess:
        process = start_server(tiny_target_folder, out_dir, *extra)
        started.append(process)
        return process

    yield start
    for process in started:
        process.stop()


@pytest.fixture(scope="module")
def keyed_server(tiny_target_folder, tmp_path_factory):
    """A server started with --api-key right, shared by the key cases (each sends its own requests)."""
    process = start_server(tiny_target_folder, tmp_path_factory.mktemp("keyed") / "run", "--api-key", "right")
    yield process
    process.stop()


@pytest.fixture(scope="module")
def deployment(tiny_target_folder, tmp_path_factory):
    """`onlinespec serve --replicas 2` on a local Ray cluster, shared by a module's tests. Its
    updates of 300 steps last long enough to kill the learner in one."""
    out_dir = tmp_path_factory.mktemp("ray") / "run"
    process = start_server(tiny_target_folder, out_dir, "--replicas", "2", "--steps-per-update", "300", "--update-interval", "4")
    process.out_dir = out_dir
    yield process
    assert process.stop() == 0


@pytest.fixture(scope="module")
def admin(deployment):
    import httpx

    return httpx.Client(base_url=deployment.url, headers={"Authorization": f"Bearer {ADMIN}"}, timeout=60)
