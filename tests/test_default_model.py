"""The default set-up of `make run`: SmolLM2 on the CPU engine, answering through the openai client."""
import openai
import pytest

from .harness import Daemon

pytestmark = pytest.mark.slow


def test_smollm2_piecewise_encoding(default_model):
    from tokenizers import Tokenizer

    from clawd.tokenizer import ChatTokenizer
    dest, _ = default_model
    tok = ChatTokenizer(dest)
    text = tok.render([{"role": "system", "content": "Be brief."}, {"role": "user", "content": "12345 café 🦦"},
                       {"role": "assistant", "content": "Yes."}, {"role": "user", "content": "  again\n"}], None)
    whole = Tokenizer.from_file(str(dest / "tokenizer.json")).encode(text, add_special_tokens=False).ids
    assert tok.encode(text) == whole and tok._splitter is not None


def test_smollm2_answers_a_chat(default_model, tmp_path):
    dest, _ = default_model
    daemon = Daemon(tmp_path, {"model": {"path": str(dest), "max_tokens_cap": 16}}, timeout=300)
    try:
        client = openai.OpenAI(base_url=daemon.url + "/v1", api_key="none", max_retries=0)
        question = [{"role": "user", "content": "What is the capital of France?"}]
        reply = client.chat.completions.create(model="clawd", messages=question, temperature=0)
        assert "Paris" in reply.choices[0].message.content
        stream = client.chat.completions.create(model="clawd", messages=question, temperature=0, stream=True)
        assert "".join(c.choices[0].delta.content or "" for c in stream) == reply.choices[0].message.content
        assert [m.id for m in client.models.list().data] == ["smollm2"]
    finally:
        assert daemon.stop() == 0
    # Greedy (T = 0) turns are served but fall outside the training contract.
    assert {r["excluded"] for r in daemon.records()} == {"sampling_params"}
