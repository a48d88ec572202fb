"""One policy-options style at the integration entry points (issue 34): ``policy="tokrag",
policy_options={...}``; the policy registry checks the options. Policy options as loose
keyword arguments (the spelling before issue 44) are refused, naming the accepted ones."""

from __future__ import annotations

import warnings

import pytest

QUESTION = "Who founded Quillfeather Aerospace?"


def _no_deprecation(call):
    with warnings.catch_warnings():
        warnings.simplefilter("error", DeprecationWarning)
        return call()


def test_chain_factories_take_policy_options_and_refuse_the_old_spelling() -> None:
    from tokrag_integrations.langchain import ChatTokRAG
    from tokrag_integrations.langchain.chains import _chat_model, create_tokrag_chain

    def build(policy_options, **options):
        return _chat_model(
            ChatTokRAG(model="default"), create_tokrag_chain, temperature=None, policy=None,
            max_tokens=None, stop=None, max_context_tokens=None,
            policy_options=policy_options, options=options,
        )[1]

    new = _no_deprecation(lambda: build({"pr_norm": "softmax"}))
    assert new["policy_options"] == {"pr_norm": "softmax"}
    with pytest.raises(TypeError, match="create_tokrag_chain .*'pr_norm'.*accepted: .*policy_options"):
        build(None, pr_norm="softmax")
    # The registry checks the options.
    with pytest.raises(TypeError, match="unknown option 'no_such_option'"):
        build({"no_such_option": 1})
    with pytest.raises(ValueError, match="pr_norm"):
        build({"pr_norm": "nope"})


def test_synthesizer_takes_policy_options_and_refuses_the_old_spelling(lm) -> None:
    from tokrag_integrations.llama_index import TokRAGSynthesizer

    new = _no_deprecation(lambda: TokRAGSynthesizer(lm, policy_options={"pr_norm": "softmax"}))
    assert new._gen_kwargs["policy_options"] == {"pr_norm": "softmax"}
    with pytest.raises(TypeError, match="TokRAGSynthesizer .*'pr_norm'.*accepted: .*policy_options"):
        TokRAGSynthesizer(lm, pr_norm="softmax")
    with pytest.raises(TypeError, match="unknown option 'no_such_option'"):
        TokRAGSynthesizer(lm, policy_options={"no_such_option": 1})


def test_chat_model_call_options(lm) -> None:
    from langchain_core.messages import HumanMessage

    from tokrag_integrations.langchain import ChatTokRAG

    chat = ChatTokRAG(model=lm, max_tokens=2)
    msgs = [HumanMessage(QUESTION)]
    passages = ["Quillfeather Aerospace was founded by Mirela Vance."]
    new = _no_deprecation(
        lambda: chat._prepare(msgs, None, {"passages": passages, "policy_options": {"pr_norm": "softmax"}})
    )
    assert new.kwargs["policy_options"]["pr_norm"] == "softmax"
    with pytest.raises(TypeError, match="'pr_norm'.*accepted: .*policy_options"):
        chat._prepare(msgs, None, {"passages": passages, "pr_norm": "softmax"})


def test_server_config_and_request_spellings() -> None:
    from tokrag_integrations.server import Limits, RequestError, parse_chat_request
    from tokrag_integrations.server.service import ServeConfig

    assert _no_deprecation(lambda: ServeConfig(policy_options={"pr_norm": "softmax"})).policy_options == {
        "pr_norm": "softmax"
    }
    with pytest.raises(TypeError, match="options"):
        ServeConfig(options={"pr_norm": "softmax"})  # type: ignore[call-arg]

    def parse(tokrag):
        body = {"model": "default", "messages": [{"role": "user", "content": QUESTION}],
                "tokrag": tokrag}
        return parse_chat_request(body, Limits(), ["rag", "tokrag"])

    new = parse({"policy_options": {"pr_norm": "softmax"}})
    assert new.options == {"pr_norm": "softmax"} and not new.warnings
    with pytest.raises(RequestError, match="unknown key.*options.*policy_options"):
        parse({"options": {"pr_norm": "softmax"}})


def test_entry_points_refuse_policy_options_as_keywords(lm) -> None:
    from tokrag_integrations import generate, generate_batch

    passages = ["Quillfeather Aerospace was founded by Mira Okafor."]
    for batching in (False, True):
        with pytest.raises(TypeError, match="unexpected keyword argument 'pr_norm'"):
            generate(lm, QUESTION, passages, policy="tokrag", pr_norm="softmax", batching=batching)
    with pytest.raises(TypeError, match="unexpected keyword argument 'pr_norm'"):
        generate_batch(lm, [QUESTION], [passages], policy="tokrag", pr_norm="softmax")
