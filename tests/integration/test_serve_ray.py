"""``tokrag serve --ray``: the app as a Ray Serve deployment with two local replicas.

Starts a local Ray instance (2 CPUs, no dashboard) and Serve's proxy on a free port, deploys
two replicas (one packaged model each, one torch thread each) and talks to them with the
official ``openai`` client. Marked slow: 61 s on 2 busy CPU cores (37 s of it Ray and the
replicas starting); run it with ``pytest -m slow tests/integration/test_serve_ray.py``.
"""

from __future__ import annotations

import os
import socket
from concurrent.futures import ThreadPoolExecutor

import pytest
from _helpers import require

require("ray.serve", "ray[serve]")
require("fastapi")
openai = require("openai")

from tokrag_integrations import generate  # noqa: E402
from tokrag_integrations.defaults import ANSWER_STOP  # noqa: E402

DOCS = ["Quillfeather Aerospace was founded in 1987 by the engineer Mara Ellison in Tromsø."]
QUESTIONS = ["Who founded Quillfeather Aerospace?", "Where was Quillfeather Aerospace founded?"]
MAX_TOKENS = 12
#: The deployment's bearer token (``ServeConfig.api_key``, what ``tokrag serve --ray --api-key``
#: hands to Ray): every replica demands it.
KEY = "r4y-k3y"


@pytest.fixture(scope="module")
def ray_url():
    import ray
    from ray import serve

    from tokrag_integrations.server import ServeConfig, ray_deployment

    env = {k: os.environ[k] for k in ("PYTHONPATH", "HF_HUB_OFFLINE") if k in os.environ}
    env.update(OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false")
    ray.init(num_cpus=2, include_dashboard=False, runtime_env={"env_vars": env},
             log_to_driver=False)
    try:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        serve.run(ray_deployment(ServeConfig(max_new_tokens=MAX_TOKENS, api_key=KEY), replicas=2),
                  name="tokrag", route_prefix="/")
        yield f"http://127.0.0.1:{port}"
    finally:
        serve.shutdown()
        ray.shutdown()


@pytest.mark.slow
def test_two_replicas_answer_like_the_core(ray_url, lm):
    from ray import serve

    states = serve.status().applications["tokrag"].deployments["tokrag"].replica_states
    assert states == {"RUNNING": 2}
    client = openai.OpenAI(base_url=f"{ray_url}/v1", api_key=KEY, max_retries=0,
                           timeout=300)
    wrong = openai.OpenAI(base_url=f"{ray_url}/v1", api_key="wrong", max_retries=0, timeout=300)
    with pytest.raises(openai.AuthenticationError):
        wrong.models.list()
    with pytest.raises(openai.AuthenticationError):
        wrong.chat.completions.create(model="default", max_tokens=MAX_TOKENS,
                                      messages=[{"role": "user", "content": QUESTIONS[0]}])

    def ask(question):
        return client.chat.completions.with_raw_response.create(
            model="default", messages=[{"role": "user", "content": question}],
            max_tokens=MAX_TOKENS, extra_body={"documents": DOCS},
        )

    questions = QUESTIONS * 4
    with ThreadPoolExecutor(8) as pool:
        raw = list(pool.map(ask, questions))
    want = {q: generate(lm, q, DOCS, max_new_tokens=MAX_TOKENS, stop=list(ANSWER_STOP))
            for q in QUESTIONS}
    answers = [r.parse() for r in raw]
    assert [a.choices[0].message.content for a in answers] == [want[q].text for q in questions]
    assert [a.model_extra["tokrag"]["counts"] for a in answers] == [
        want[q].trace.counts() for q in questions
    ]
    assert len({r.headers["x-tokrag-replica"] for r in raw}) == 2  # both replicas decoded
    # One x-request-id, Ray's proxy's (the client's when given); the replicas add none.
    assert all(len(r.headers.get_list("x-request-id")) == 1 for r in raw)
    given = client.with_options(default_headers={"x-request-id": "ray-1"}).models
    assert given.with_raw_response.list().headers.get_list("x-request-id") == ["ray-1"]
    # /metrics: the metrics of the replica that answered (behind the key, as /v1/*).
    import httpx
    from prometheus_client.parser import text_string_to_metric_families

    assert httpx.get(f"{ray_url}/metrics", timeout=60).status_code == 401
    r = httpx.get(f"{ray_url}/metrics", headers={"Authorization": f"Bearer {KEY}"}, timeout=60)
    names = {f.name for f in text_string_to_metric_families(r.text)}
    assert {"tokrag_requests", "tokrag_generated_tokens"} <= names

    chunks = client.chat.completions.create(
        model="default", messages=[{"role": "user", "content": QUESTIONS[0]}],
        max_tokens=MAX_TOKENS, extra_body={"documents": DOCS}, stream=True,
    )
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == (
        want[QUESTIONS[0]].text
    )


@pytest.mark.slow
def test_replicas_refuse_hostile_bodies_like_the_single_process_server(ray_url):
    """Issue 43: the Ray path runs the same boundary checks (a 400 naming the field, before
    the decode), streamed or not, and /health shows no pid."""
    import httpx

    auth = {"Authorization": f"Bearer {KEY}"}  # the fixture's deployment demands it
    body = (b'{"messages": [{"role": "user", "content": "Who?"}], "max_tokens": 4, '
            b'"stream": %s, "documents": [{"text": "d", "score": NaN}]}')
    for stream in (b"false", b"true"):
        r = httpx.post(f"{ray_url}/v1/chat/completions", content=body % stream,
                       headers={"Content-Type": "application/json", **auth}, timeout=120)
        assert r.status_code == 400, r.text
        assert r.json()["error"]["param"] == "documents[0].score"
    r = httpx.post(f"{ray_url}/v1/chat/completions", timeout=120, headers=auth, json={
        "messages": [{"role": "user", "content": "Who?"}], "stream": True,
        "tokrag": {"policy_options": {"fixed_layer": 1_000_000}}})
    assert r.status_code == 400 and r.json()["error"]["param"] == "tokrag.policy_options"
    health = httpx.get(f"{ray_url}/health", timeout=60).json()
    assert "pid" not in health and health["replica"]
