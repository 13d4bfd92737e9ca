"""One turn of the learning loop by hand: engine rollout → samples → trainer child → published weights →
the engine swaps to them. The daemon's learner makes these calls, to a child spawned like this one:
`trainer_options` and the link's default handler, the real trainer."""
from __future__ import annotations

import json
import urllib.request

import pytest

from clawd.config.model import ModelConfig
from clawd.config.schema import Config
from clawd.config.scoring import ScoringConfig
from clawd.config.state import StateConfig
from clawd.config.train import LossConfig, OptimizerConfig, TrainConfig
from clawd.engine.client import EngineClient
from clawd.samples import Sample
from clawd.tokenizer import ChatTokenizer
from clawd.trainer.link import TrainerLink
from clawd.trainer.options import trainer_options
from tests.test_teacher import engine_url  # noqa: F401  (a CPU engine on the tiny model)


def _post(url, body):
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=60) as resp:
        return json.loads(resp.read() or b"null")


async def _rollout(engine, prompt, seed):
    out = await engine.generate({"input_ids": prompt, "return_logprob": True, "sampling_params": {
        "temperature": 1.0, "top_p": 1.0, "top_k": -1, "max_new_tokens": 8, "sampling_seed": seed}})
    return out["output_ids"], [e[0] for e in out["meta_info"]["output_token_logprobs"]]


@pytest.mark.slow
async def test_trained_weights_are_published_and_served(engine_url, tiny_model, tmp_path):  # noqa: F811
    tok = ChatTokenizer(tiny_model)
    engine = EngineClient(engine_url)
    await engine.start()
    samples = []
    for i in range(4):
        prompt = tok.encode_chat([{"role": "user", "content": f"Say something nice, number {i}."}], None)
        ids, lps = await _rollout(engine, prompt, seed=i)
        samples.append(Sample(sample_id=f"s{i}", mode="rl", session_id=f"sess{i}", turn_index=0, principal="p",
                              tokens=prompt + ids, response_length=len(ids), loss_mask=[1] * len(ids),
                              rollout_logprobs=lps, temperature=1.0, reward=1.0, teacher_logprobs=None,
                              has_hint=False, policy_version=0, created=0.0, scored=0.0))

    # The raw reward: four +1s measured against their own mean (the default baseline) would teach nothing.
    train = TrainConfig(seed=0, checkpoint_every=1, optimizer=OptimizerConfig(lr=1e-2),
                        loss=LossConfig(reward_baseline="none"))
    cfg = Config(model=ModelConfig(path=str(tiny_model)), state=StateConfig(dir=str(tmp_path / "state")),
                 scoring=ScoringConfig(mode="rl"), train=train)
    link = TrainerLink(trainer_options(cfg))
    ready = await link.start()
    assert (ready.step, ready.version) == (0, 0)
    try:
        reply = await link.request({"type": "train", "batch_id": "b1", "version": 1,
                                    "samples": samples}, timeout=120)
    finally:
        assert await link.stop() == 0
    assert reply["type"] == "trained", reply
    assert reply["checkpointed"] is True and reply["metrics"]["skipped"] is False
    weights = reply["weights_dir"]
    assert weights.endswith("v000001")

    update = _post(engine_url + "/update_weights_from_disk", {"model_path": weights, "weight_version": "1"})
    assert update["success"] is True
    info = await engine.model_info()
    assert info["weight_version"] == "1"
    # Reward +1 at a large learning rate: the trained responses became more likely.
    for s in samples:
        out = _post(engine_url + "/generate", {
            "input_ids": s.tokens, "return_logprob": True, "logprob_start_len": len(s.prompt_ids) - 1,
            "sampling_params": {"max_new_tokens": 0}})
        assert out["meta_info"]["weight_version"] == "1"
        after = [e[0] for e in out["meta_info"]["input_token_logprobs"][1:]]
        assert sum(after) > sum(s.rollout_logprobs)
    await engine.close()
