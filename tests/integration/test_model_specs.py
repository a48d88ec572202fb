"""Issue 22: every adapter takes the same model spec and load options as ``load_model``,
rejects unknown keyword arguments naming the accepted ones, and checks a sampling
temperature with the same sentence."""

from __future__ import annotations

import pytest
import torch

from tokrag_integrations.policies import available_policies

Q, P = "Who wrote it?", ["Ann wrote the book.", "Bob read the book."]


def _tiny_qwen2(vocab_size: int):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    cfg = Qwen2Config(
        vocab_size=vocab_size, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048,
        tie_word_embeddings=True, initializer_range=0.2,
    )
    torch.manual_seed(0)
    return Qwen2ForCausalLM(cfg).eval()


@pytest.fixture(scope="module")
def folder(tmp_path_factory, lm):
    """A random-weight Qwen2-style model saved with the default model's tokenizer."""
    path = tmp_path_factory.mktemp("tiny-qwen2-spec")
    _tiny_qwen2(lm.vocab_size).save_pretrained(path)
    lm.tokenizer.save_pretrained(path)
    return path


def test_llama_index_llm_and_synthesizer_take_the_spec(folder, lm):
    from llama_index.core.schema import NodeWithScore, TextNode

    from tokrag_integrations.llama_index import TokRAGLLM, TokRAGSynthesizer

    llm = TokRAGLLM(model=folder, dtype="bfloat16", device="cpu", max_new_tokens=3)
    assert llm.loaded_model.model.dtype == torch.bfloat16 and llm.model == str(folder)
    for policy in available_policies():
        r = llm.complete(Q, passages=P, policy=policy)
        assert r.additional_kwargs["policy"] == policy
    loaded = TokRAGLLM(model=_tiny_qwen2(lm.vocab_size), tokenizer=lm.tokenizer, max_new_tokens=2)
    assert loaded.model == "Qwen2ForCausalLM"
    synth = TokRAGSynthesizer(model=str(folder), dtype=torch.bfloat16, max_new_tokens=3)
    assert synth.loaded_model.model.dtype == torch.bfloat16
    nodes = [NodeWithScore(node=TextNode(text=t), score=1.0 - i / 10) for i, t in enumerate(P)]
    assert synth.synthesize(Q, nodes).metadata["policy"] == "tokrag"


def test_langchain_chat_and_chain_take_the_spec(folder, lm):
    from langchain_core.documents import Document
    from langchain_core.runnables import RunnableLambda

    from tokrag_integrations.langchain import ChatTokRAG, create_tokrag_chain

    chat = ChatTokRAG(model=folder, dtype="bfloat16", max_tokens=3)
    assert chat.loaded_model.model.dtype == torch.bfloat16
    for policy in available_policies():
        msg = chat.invoke(Q, passages=P, policy=policy)
        assert msg.response_metadata["policy"] == policy
    given = ChatTokRAG(model=_tiny_qwen2(lm.vocab_size), tokenizer=lm.tokenizer, max_tokens=2)
    assert given.model_name == "Qwen2ForCausalLM" and given.invoke(Q).response_metadata
    retriever = RunnableLambda(lambda q: [Document(page_content=t) for t in P])
    chain = create_tokrag_chain(retriever, str(folder), dtype="bfloat16", max_tokens=3)
    assert chain.model.loaded_model.model.dtype == torch.bfloat16
    assert chain.invoke(Q)["context"]


def test_typos_are_rejected_naming_the_accepted_arguments(folder):
    from langchain_core.runnables import RunnableLambda

    from tokrag_integrations.langchain import ChatTokRAG, create_tokrag_chain
    from tokrag_integrations.llama_index import TokRAGLLM, TokRAGSynthesizer

    retriever = RunnableLambda(lambda q: [])
    for make in (
        lambda: TokRAGLLM(model=folder, device_mapp="auto"),
        lambda: TokRAGSynthesizer(model=folder, device_mapp="auto"),
        lambda: ChatTokRAG(model=folder, device_mapp="auto"),
        lambda: create_tokrag_chain(retriever, folder, device_mapp="auto"),
    ):
        with pytest.raises((TypeError, ValueError), match=r"'device_mapp'.*accepts?.*device_map"):
            make()
    with pytest.raises(TypeError, match="'generate_kwargs'.*accepted: .*device_map"):
        TokRAGLLM(model=folder, generate_kwargs={"do_sample": True})


def test_temperature_is_checked_the_same_way_everywhere(folder, lm):
    """Every adapter samples now (issue 57); a bad temperature is refused with one sentence
    before anything loads, and a seeded sampled answer repeats."""
    from langchain_core.documents import Document
    from langchain_core.runnables import RunnableLambda
    from llama_index.core.schema import NodeWithScore, TextNode

    from tokrag_integrations.langchain import ChatTokRAG, create_tokrag_chain
    from tokrag_integrations.llama_index import TokRAGLLM, TokRAGSynthesizer

    for make in (
        lambda: TokRAGSynthesizer(model=folder, temperature=-1),
        lambda: TokRAGLLM(model=folder, temperature=-1),
        lambda: ChatTokRAG(model=folder, temperature=-1),
        lambda: create_tokrag_chain(RunnableLambda(lambda q: []), folder, temperature=-1),
    ):
        with pytest.raises(ValueError, match=r"temperature must be in \[0, "):
            make()

    nodes = [NodeWithScore(node=TextNode(text=p), score=1.0) for p in P]

    def synth(**kw):
        s = TokRAGSynthesizer(lm, max_new_tokens=8, **kw)
        return s.synthesize(Q, nodes=nodes).response

    assert synth(temperature=2.0, seed=5) == synth(temperature=2.0, seed=5)
    assert synth(temperature=2.0, seed=5) != synth()  # 8 tokens drawn at T=2 vs greedy
    docs = RunnableLambda(lambda q: [Document(page_content=p) for p in P])

    def chain(**kw):
        chat = ChatTokRAG(model=lm, seed=5)
        return create_tokrag_chain(docs, chat, max_tokens=8, **kw).invoke(Q)["answer"]

    assert chain(temperature=2.0) == chain(temperature=2.0)
    assert chain(temperature=2.0) != chain()


def _cli(argv: list[str]) -> tuple[int, str, str]:
    import contextlib
    import io

    from tokrag_integrations import cli

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = cli.main(argv)
        except SystemExit as exc:
            code = int(exc.code or 0)
    return code, out.getvalue(), err.getvalue()


def test_cli_takes_the_spec(folder, tmp_path):
    import json

    trace = tmp_path / "t.json"
    code, _, err = _cli(
        ["ask", Q, "--passage", P[0], "--model", str(folder), "--device", "cpu",
         "--dtype", "bfloat16", "--max-new-tokens", "2", "--json", str(trace)]
    )  # fmt: skip
    assert code == 0, err
    assert json.loads(trace.read_text())["policy"] == "tokrag"
    code, _, err = _cli(["ask", Q, "--model", str(folder), "--device", "cpu", "--device-map", "auto"])
    assert code == 2 and "--device or --device-map, not both" in err
    code, _, err = _cli(["ask", Q, "--model", "not-cached/model"])
    assert code == 2 and "huggingface-cli download not-cached/model" in err


def test_load_options_with_a_loaded_model_raise(lm):
    from tokrag_integrations.langchain import ChatTokRAG
    from tokrag_integrations.llama_index import TokRAGLLM

    with pytest.raises(ValueError, match="dtype apply to loading a model"):
        TokRAGLLM(lm, dtype="bfloat16")
    with pytest.raises(ValueError, match="device_map apply to loading a model"):
        ChatTokRAG(model=lm, device_map="auto")
