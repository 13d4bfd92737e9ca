"""End to end: the real daemon process + the CPU engine (tiny model) + the official openai client."""
from __future__ import annotations

import json
import urllib.request

import openai
import pytest

from .harness import Daemon


@pytest.fixture(scope="module")
def daemon(tiny_model, tmp_path_factory):
    d = Daemon(tmp_path_factory.mktemp("e2e"), {
        "model": {"path": str(tiny_model), "max_tokens_cap": 24},
        "engine": {"launch": "local", "seed": 7},
        "sessions": {"session_idle_timeout": 600.0},
    })
    yield d
    assert d.stop() == 0


@pytest.fixture(scope="module")
def client(daemon):
    return openai.OpenAI(base_url=daemon.url + "/v1", api_key="none", max_retries=0)


def _post(url: str, body: dict) -> dict:
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=60) as resp:
        return json.loads(resp.read())


@pytest.mark.slow
def test_non_streamed_chat(client):
    reply = client.chat.completions.create(model="clawd", messages=[{"role": "user", "content": "Hello there"}],
                                           max_tokens=12)
    choice = reply.choices[0]
    assert reply.object == "chat.completion"
    assert choice.message.role == "assistant"
    assert choice.finish_reason in ("stop", "length", "tool_calls")
    assert reply.usage.completion_tokens >= 1
    assert reply.usage.total_tokens == reply.usage.prompt_tokens + reply.usage.completion_tokens


def test_streamed_chat_matches_usage(client):
    stream = client.chat.completions.create(model="clawd", messages=[{"role": "user", "content": "Stream it"}],
                                            max_tokens=10, stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert finishes[-1] in ("stop", "length", "tool_calls") and all(f is None for f in finishes[:-1])
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens >= 1
    # Tokens arrive as they are generated: more than the role chunk and the final chunk.
    assert len([c for c in chunks if c.choices]) >= 3


@pytest.mark.slow
def test_three_turns_without_headers_make_one_session(client, daemon, tiny_model):
    messages = [{"role": "user", "content": "Tell me a fact about otters."}]
    for question in ("Another one?", "And one more."):
        reply = client.chat.completions.create(model="clawd", messages=messages, seed=11, temperature=1.0)
        messages += [reply.choices[0].message.model_dump(exclude_none=True), {"role": "user", "content": question}]
    client.chat.completions.create(model="clawd", messages=messages, seed=11)

    status, proc = daemon.get("/debug/process")
    assert proc["threads"] == 1 and proc["torch_imported"] is False and proc["transformers_imported"] is False

    first_two = [r for r in daemon.records() if r["messages"][0]["content"] == "Tell me a fact about otters."]
    assert len(first_two) == 2
    _check_against_engine(proc["engines"]["policy"]["url"], first_two[0])

    daemon.stop()  # closes the live session: its last turn is recorded with reason "shutdown"
    records = [r for r in daemon.records() if r["messages"][0]["content"] == "Tell me a fact about otters."]
    assert len(records) == 3
    assert len({r["session_id"] for r in records}) == 1
    by_index = {r["turn_index"]: r for r in records}
    assert by_index[0]["next_state"] == [{"role": "user", "content": "Another one?"}]
    assert by_index[1]["next_state"] == [{"role": "user", "content": "And one more."}]
    assert by_index[2]["next_state"] is None and by_index[2]["reason"] == "shutdown"
    for r in records:
        assert "authorization" not in json.dumps(r).lower()
        assert len(r["response_ids"]) == len(r["response_logprobs"]) >= 1

    _check_against_model(tiny_model, records)


def _check_against_engine(engine_url, rec):
    """The recorded ids are the engine's output ids: it replays the seeded request exactly."""
    direct = _post(engine_url + "/generate", {
        "input_ids": rec["prompt_ids"], "return_logprob": True,
        "sampling_params": {"temperature": rec["temperature"], "top_p": 1.0, "top_k": -1, "sampling_seed": 11,
                            "max_new_tokens": len(rec["response_ids"]), "no_stop_trim": True,
                            "skip_special_tokens": False}})
    assert direct["output_ids"] == rec["response_ids"]
    assert [e[0] for e in direct["meta_info"]["output_token_logprobs"]] == pytest.approx(rec["response_logprobs"],
                                                                                         abs=1e-5)


def _check_against_model(tiny_model, records):
    """Recorded log-probs match a teacher-forced forward pass at the sample's temperature."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32).eval()
    for rec in records:
        ids = torch.tensor([rec["prompt_ids"] + rec["response_ids"]])
        with torch.inference_mode():
            logits = model(ids).logits[0].float()
        p = len(rec["prompt_ids"])
        lps = torch.log_softmax(logits[p - 1:-1] / rec["temperature"], dim=-1)
        expected = lps.gather(1, torch.tensor(rec["response_ids"])[:, None])[:, 0]
        assert torch.allclose(expected, torch.tensor(rec["response_logprobs"]), atol=1e-4), rec["turn_index"]
