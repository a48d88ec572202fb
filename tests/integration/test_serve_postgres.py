"""``tokrag serve --store postgres``: with no ``documents`` the server retrieves from an
ingested table itself (a real embedded PostgreSQL + pgvector from pgserver)."""

from __future__ import annotations

import pytest
from _helpers import LiveServer, require

require("fastapi")
require("pgserver")
openai = require("openai")

from tokrag_integrations import generate  # noqa: E402
from tokrag_integrations.defaults import ANSWER_STOP  # noqa: E402

pytestmark = pytest.mark.postgres

QUESTION = "How many days of annual leave do full-time employees at Quillfeather get?"
MAX_TOKENS = 12
TOP_K = 3


@pytest.fixture(scope="module")
def store_server(lm, module_pg_dsn):
    from tokrag_integrations.postgres import PostgresKnowledgeBase, ingest
    from tokrag_integrations.retrieval import get_sample_docs_path
    from tokrag_integrations.server import ChatService, ServeConfig, create_app

    dsn = module_pg_dsn
    ingest([get_sample_docs_path()], dsn=dsn, table="serve_docs", progress=False)
    kb = PostgresKnowledgeBase(dsn, "serve_docs")
    config = ServeConfig(store="postgres", dsn=dsn, table="serve_docs", top_k=TOP_K,
                         max_new_tokens=MAX_TOKENS)
    live = LiveServer(create_app(ChatService(lm, config, kb)))
    live.kb = kb
    yield live
    live.stop()
    kb.close()


def _ask(live, **extra):
    return live.client().chat.completions.create(
        model="default", messages=[{"role": "user", "content": QUESTION}],
        max_tokens=MAX_TOKENS, extra_body=extra,
    )


def test_the_server_retrieves_when_the_request_has_no_documents(store_server, lm):
    chunks = store_server.kb.retrieve(QUESTION, top_k=TOP_K)
    want = generate(lm, QUESTION, [c.text for c in chunks], max_new_tokens=MAX_TOKENS,
                    stop=list(ANSWER_STOP))
    r = _ask(store_server)
    assert r.choices[0].message.content == want.text
    t = r.model_extra["tokrag"]
    sources = sorted(t["sources"], key=lambda s: s["rank"])  # listed by contribution
    assert [s["text"] for s in sources] == [c.text for c in chunks]
    assert [s["metadata"]["source"] for s in sources] == [c.source for c in chunks]
    assert [s["metadata"]["node_id"] for s in sources] == [c.node_id for c in chunks]
    assert sources[0]["score"] == pytest.approx(chunks[0].score)
    ids = {c.node_id: c.source for c in chunks}
    assert t["citations"] and all(
        ids[c["metadata"]["node_id"]] == c["source"] for c in t["citations"]
    )


def test_filters_and_top_k_reach_the_store(store_server):
    r = _ask(store_server, tokrag={"filters": {"file_name": "offices.md"}, "top_k": 2})
    sources = r.model_extra["tokrag"]["sources"]
    assert len(sources) == 2
    assert {s["metadata"]["file_name"] for s in sources} == {"offices.md"}


def test_documents_in_the_request_win_over_the_store(store_server):
    r = _ask(store_server, documents=["Employees get 99 days of leave."])
    assert [s["text"] for s in r.model_extra["tokrag"]["sources"]] == [
        "Employees get 99 days of leave."
    ]


def test_a_bad_filter_is_a_400(store_server):
    with pytest.raises(openai.BadRequestError) as info:
        _ask(store_server, tokrag={"filters": {"bad key;": "x"}})
    assert info.value.body["param"] == "tokrag.filters"
