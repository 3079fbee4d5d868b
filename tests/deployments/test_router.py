"""vlm_serve behind sglang-router, started as the README starts it. In the router's normal mode two
colocated servers of the built-in model are data-parallel replicas: chat completions (with an image,
with n=2, streamed, a repeated image, a video, an image and a video, json_schema, a named tool, 32 at
once), text completions (a batch with n=2) and SGLang's /generate (with an image, streamed, a batch with
n=2) come back through the router exactly as one server answers them (greedy),
and the router names the model as the servers' /model_info does. The router in its PD mode, over the
same two colocated servers (which accept the bootstrap fields it adds and ignore them), answers the
same too. Real processes: the router's binary and two `vlm-serve serve`."""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import pytest

from helpers import ServerProcess, client_answers, deployment_answers, metric, running_router, running_server
from vlm_serve.builtin import BUILTIN_MODEL
from vlm_serve.tokenizer import Tokenizer

pytestmark = pytest.mark.server  # every test here starts a real server

TOKENIZER = Tokenizer.from_pretrained(BUILTIN_MODEL)


@pytest.fixture(scope="module")
def servers() -> Iterator[list[ServerProcess]]:
    with running_server(BUILTIN_MODEL) as first, running_server(BUILTIN_MODEL) as second:
        yield [first, second]


@pytest.fixture(scope="module")
def replicas(servers: list[ServerProcess]) -> Iterator[str]:
    """The router in its normal mode, cache-aware, over both servers."""
    with running_router("--worker-urls", *(s.url for s in servers), "--policy", "cache_aware") as url:
        yield url


def test_the_router_names_the_model_as_the_servers_report_it(servers: list[ServerProcess], replicas: str) -> None:
    served = httpx.get(servers[0].url + "/model_info").json()["served_model_name"]
    assert [model["id"] for model in httpx.get(replicas + "/v1/models").json()["data"]] == [served]
    workers = httpx.get(replicas + "/workers").json()["workers"]
    assert sorted(w["url"] for w in workers) == sorted(s.url for s in servers)
    assert all(w["is_healthy"] and w["metadata"]["model_path"] == str(BUILTIN_MODEL) for w in workers)
    # the router probes each server for gRPC first: they answer with a 400 and print nothing about it
    assert [line for server in servers for line in server.output if "serving" not in line] == []


def test_replicas_behind_the_router_answer_as_one_server(servers: list[ServerProcess], replicas: str) -> None:
    """Both replicas take a share of the requests (cache-aware: a prompt goes where its prefix is cached,
    a new one to the replica with the least cached)."""
    one_server = deployment_answers(servers[0].url, TOKENIZER, cached_tokens=False)
    assert one_server["chat"][0] == "The circle is red."
    before = [metric(server.url, "requests_total") for server in servers]
    assert deployment_answers(replicas, TOKENIZER, cached_tokens=False) == one_server
    received = [metric(server.url, "requests_total") - count for server, count in zip(servers, before)]
    assert min(received) > 0


def test_the_router_in_pd_mode_over_colocated_servers_answers_as_one_server(servers: list[ServerProcess]) -> None:
    """Each request goes to both servers with bootstrap_host/port/room (lists for chat with n=2 and for
    batches); a colocated server serves it whole, and the router returns the "decode" server's answer."""
    prefill, decode = servers
    with running_router("--pd-disaggregation", "--prefill", prefill.url, "8998", "--decode", decode.url) as url:
        assert client_answers(url, TOKENIZER) == client_answers(decode.url, TOKENIZER)
