"""The gate before promotion: the paired decision (exact values), the evaluation through an engine (the
pairing of seeds, adapters, rubric checks, failures contained), and on the real daemon a poisoned run
whose version is rejected on a canary replica and never serves a session."""
from __future__ import annotations

import asyncio
import json
import zlib

import pytest

from clawd.safety import evalset
from clawd.safety.gate import GateUnavailable, PromotionGate, decide, seed_of
from clawd.safety.versions import REJECTED, Versions
from clawd.config.gate import GateConfig
from clawd.tools.sim import personas
from clawd.tools.sim.users import Users

from .harness import Daemon


# --- the decision ------------------------------------------------------------------------------

def test_a_candidate_worse_beyond_the_margin_and_confidently_is_rejected():
    incumbent = [1.0] * 20
    candidate = [0.0] * 10 + [1.0] * 10
    verdict = decide(candidate, incumbent, None, margin=0.05, level=0.95)
    assert (verdict["passed"], verdict["score"], verdict["incumbent"], verdict["diff"]) == (False, 0.5, 1.0, -0.5)
    assert verdict["high"] < 0
    assert verdict["detail"] == ("against the incumbent 100% -> 50%: -50 pts [-70, -25] (95%, 20 pairs; 0 up, "
                                 "10 down): worse by more than the margin (5%), interval below 0")


def test_a_dip_within_the_margin_or_one_the_interval_does_not_confirm_passes():
    within = decide([0.0] + [1.0] * 19, [1.0] * 20, None, margin=0.05, level=0.95)
    assert within["passed"] and within["diff"] == pytest.approx(-0.05)
    unconfirmed = decide([0.0, 1.0, 1.0, 1.0], [1.0] * 4, None, margin=0.05, level=0.95)
    assert unconfirmed["passed"] and unconfirmed["diff"] == -0.25 and unconfirmed["high"] == 0.0
    same = decide([0.5] * 8, [0.5] * 8, None, margin=0.0, level=0.95)
    assert same["passed"] and same["detail"] == "gate score 50% -> 50%: +0 pts [+0, +0] (95%, 8 pairs; 0 up, 0 down)"


def test_small_steps_within_the_margin_cannot_drift_far_from_the_baseline():
    baseline = [1.0] * 20
    incumbent = [0.0] * 3 + [1.0] * 17   # two steps of -5 points each passed: now 15 below the baseline
    candidate = [0.0] * 4 + [1.0] * 16   # one more step of -5: fine against the incumbent alone
    assert decide(candidate, incumbent, None, margin=0.1, level=0.95)["passed"]
    verdict = decide(candidate, incumbent, baseline, margin=0.1, level=0.95)
    assert not verdict["passed"] and (verdict["baseline"], verdict["baseline_diff"]) == (1.0, -0.2)
    assert verdict["detail"].startswith("against the baseline 100% -> 80%: -20 pts")


def test_seeds_are_fixed_per_prompt_and_answer():
    assert seed_of("capital-portugal", 1) == zlib.crc32(b"capital-portugal/1")
    assert seed_of("a", 0) != seed_of("a", 1) != seed_of("b", 1)


# --- the evaluation ---------------------------------------------------------------------------------

class Words:
    """A tokenizer of whole texts: a chat is one id, an answer's id is its index in `answers`."""
    answers = ["Lisbon.", "The answer is a planet.", "It is Lisbon, on the Tagus."]

    def encode_chat(self, messages, tools):
        return [len(messages)]

    def decode(self, ids):
        return self.answers[ids[0]]


class Engine:
    """Answers by adapter: "good" says Lisbon, "bad" the planet; the base either, as its seed says."""

    def __init__(self, fail: bool = False):
        self.payloads: list[dict] = []
        self.fail = fail

    async def generate(self, payload):
        if self.fail:
            from clawd.engine.client import EngineUnavailable
            raise EngineUnavailable("connection refused")
        self.payloads.append(payload)
        seed = payload["sampling_params"]["sampling_seed"]
        return {"output_ids": [{"good": 2, "bad": 1}.get(payload.get("lora_path"), seed % 2)]}


class Judge:
    def __init__(self):
        self.asked: list[list[dict]] = []

    async def complete(self, messages):
        self.asked.append(messages)
        return "No." if "planet" in messages[-1]["content"] else "YES"  # the quoted reply is in the last message


PROMPTS = tuple(evalset.parse_prompt({"id": f"p{i}", "messages": [{"role": "user", "content": "Capital of Portugal?"}],
                                      "check": {"contains_any": ["Lisbon"], "max_words": 20}}, f"p{i}")
                for i in range(6))


def test_versions_are_asked_the_same_prompts_with_the_same_seeds_and_scored_per_prompt():
    engine = Engine()
    gate = PromotionGate(GateConfig(samples_per_prompt=3, max_tokens=12, temperature=0.5), PROMPTS, Words(), engine)
    good, bad = asyncio.run(gate.outcomes("good")), asyncio.run(gate.outcomes("bad"))
    assert good == [1.0] * 6 and bad == [0.0] * 6
    base = asyncio.run(gate.outcomes(None))
    assert base == [sum(seed_of(f"p{i}", k) % 2 == 0 for k in range(3)) / 3 for i in range(6)]
    by_adapter: dict = {}
    for p in engine.payloads:
        by_adapter.setdefault(p.get("lora_path"), []).append((p["rid"].split("-")[1:3], p["sampling_params"]))
    assert sorted(by_adapter["good"]) == sorted(by_adapter["bad"]) == sorted(by_adapter[None])  # the pairing
    assert engine.payloads[0]["sampling_params"] | {"sampling_seed": 0} == {
        "temperature": 0.5, "max_new_tokens": 12, "sampling_seed": 0}
    assert "lora_path" not in engine.payloads[-1]


def test_a_rubric_is_asked_of_the_judge_with_the_reply_quoted():
    prompt = evalset.parse_prompt({"id": "r", "messages": [{"role": "user", "content": "Capital of Portugal?"}],
                                   "check": {"rubric": "Does the reply name Lisbon?"}}, "r")
    judge = Judge()
    gate = PromotionGate(GateConfig(samples_per_prompt=2), (prompt,), Words(), Engine(), judge)
    assert gate.needs_judge
    assert asyncio.run(gate.outcomes("good")) == [1.0] and asyncio.run(gate.outcomes("bad")) == [0.0]
    assert len(judge.asked) == 4 and "Does the reply name Lisbon?" in json.dumps(judge.asked[0])


def test_a_failing_engine_gives_no_verdict_rather_than_a_wrong_one():
    gate = PromotionGate(GateConfig(), PROMPTS, Words(), Engine(fail=True))
    with pytest.raises(GateUnavailable, match="connection refused"):
        asyncio.run(gate.outcomes(None))


# --- the daemon: a poisoned run on two replicas ------------------------------------------------------

def gate_set(path) -> str:
    """Prompts the tiny model answers with a few words (random ones: it is untrained); the check wants
    three words at least, which the poisoned training below takes away."""
    lines = [{"id": f"talk-{i}", "messages": [{"role": "user", "content": f"Tell me about thing number {i}."}],
              "check": {"min_words": 3}} for i in range(24)]
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    return str(path)


@pytest.mark.slow
async def test_a_version_trained_on_adversarial_rewards_is_rejected_on_its_canary_and_never_serves(tiny_model,
                                                                                                  tmp_path):
    daemon = Daemon(tmp_path, {
        "model": {"path": str(tiny_model), "max_tokens_cap": 8},
        "engine": {"launch": "local", "seed": 1, "replicas": 2},
        "learner": {"enabled": True, "rollout_batch_size": 8, "min_batch_size": 8},
        # one update a batch, sample_mean: the step this test's canary collapse was calibrated on
        "train": {"checkpoint_every": 1, "seed": 1, "ppo_mini_batches": 1, "optimizer": {"lr": 0.3},
                  "loss": {"reward_baseline": "batch_mean",
                           "aggregation": "sample_mean"}}, "versions": {"rollback_depth": 2},
        "gate": {"enabled": True, "set": gate_set(tmp_path / "gate.jsonl"), "samples_per_prompt": 2,
                 "max_tokens": 8, "temperature": 1.0, "margin": 0.05}})
    # The poison: terse users thank replies of under three words whatever they say, and correct the rest;
    # at this learning rate one or two such batches do the damage.
    users = Users(daemon.url, [personas.FORM_ONLY_PERSONAS["terse"]], seed=3, concurrency=4, max_tokens=8,
                  tool_share=0.0, stream_share=0.0)

    async def until_rejected() -> None:  # and the learning paused (after the rollback)
        while not (await asyncio.to_thread(lambda: daemon.get("/debug/process")[1]))["paused"]["reasons"]:
            await asyncio.sleep(0.2)
        users.stop()

    try:
        await asyncio.wait_for(asyncio.gather(users.run(), until_rejected()), 150)
        await users.close()
        status = daemon.get("/debug/process")[1]
    finally:
        assert daemon.stop() == 0
    history = list(Versions(daemon.state / "versions.jsonl"))
    rejected = [v for v in history if v.status == REJECTED]
    print(json.dumps([(v.version, v.status, (v.gate or {}).get("detail")) for v in history], indent=1))
    assert len(rejected) == 1 and not rejected[0].gate["passed"]
    assert [r["reason"] for r in status["paused"]["reasons"]] == ["gate"]
    bad = rejected[0].version
    assert status["policy"]["version"] == rejected[0].parent  # the version it would have replaced still serves
    served = {t["policy_version"] for t in daemon.records()} | {r.version for r in users.replies}
    assert bad not in served  # held on the canary: no session ever reached it
    kept = (daemon.state / "rejected" / f"v{bad:06d}.samples.jsonl").read_text().splitlines()
    assert len(kept) == 8  # its batch, kept for inspection and never trained again


# --- where the candidate is held: LoRA adapter, canary replica, or promoted first ----------------------

class Staging:
    """The learner's publisher as Promotion uses it: records the calls."""
    base_dir = "/base"

    def __init__(self, canary=None):
        self.calls: list[tuple] = []
        self.canary = canary  # the replica's engine hold_apart gives; None: one engine, nothing to hold apart

    lora = True

    def adapter_of(self, version):  # None for full weights, as the real one
        return f"clawd-v{version}" if self.lora else None

    async def stage(self, weights, version):
        self.calls.append(("stage", version))

    def unstage(self, version):
        self.calls.append(("unstage", version))

    async def hold_apart(self, weights, version):
        self.calls.append(("hold_apart", version))
        return self.canary

    async def release(self, back_to):
        self.calls.append(("release", back_to))


def promotion(tmp_path, *, lora: bool, answers: dict, canary: bool = False):
    from clawd.learning.promotion import Promotion
    from clawd.safety.versions import CANDIDATE, SERVING, Version
    from clawd.served import Policy

    history = Versions(tmp_path / "versions.jsonl")
    history.add(Version(1, 0, 0.0, SERVING))
    history.add(Version(2, 1, 0.0, CANDIDATE))
    policy = Policy(version=1, weight_version="1", weights_dir="/w/v1", adapter="clawd-v1" if lora else None)

    class ByAdapter(Engine):
        async def generate(self, payload):
            self.payloads.append(payload)
            return {"output_ids": [answers[payload.get("lora_path")]]}

    engine = ByAdapter()
    publisher = Staging(engine if canary else None)
    publisher.lora = lora
    gate = PromotionGate(GateConfig(samples_per_prompt=1), PROMPTS, Words(), engine)
    published = []

    async def publish(weights, version, promote=True):
        published.append((version, promote))
        return True

    return Promotion(gate, history, publisher, policy, lora=lora), publisher, engine, published, history


def test_lora_a_candidate_adapter_is_scored_unserved_then_promoted_or_unloaded(tmp_path):
    good, publisher, engine, published, history = promotion(tmp_path / "a", lora=True,
                                                            answers={"clawd-v1": 0, "clawd-v2": 2})
    verdict = asyncio.run(good.deliver("/w/v2", 2, lambda *a, **k: asyncio.sleep(0, True)))
    assert verdict["passed"] and history.get(2).status == "serving" and history.get(1).status == "retired"
    assert publisher.calls == [("stage", 2), ("release", None)]
    assert {p["lora_path"] for p in engine.payloads} == {"clawd-v1", "clawd-v2"}  # asked by name, never served

    bad, publisher, engine, published, history = promotion(tmp_path / "b", lora=True,
                                                           answers={"clawd-v1": 0, "clawd-v2": 1})
    verdict = asyncio.run(bad.deliver("/w/v2", 2, lambda *a, **k: asyncio.sleep(0, True)))
    assert not verdict["passed"] and history.get(2).gate["passed"] is False
    assert publisher.calls == [("stage", 2), ("release", ("/w/v1", "1")), ("unstage", 2)]
    assert history.get(1).status == "serving"  # the learner rolls the trainer back; v1 never stopped serving


def test_full_weights_a_canary_holds_the_candidate_or_one_engine_serves_it_to_check_it(tmp_path):
    canary, publisher, _, published, _ = promotion(tmp_path / "a", lora=False, answers={None: 0}, canary=True)

    async def publish(weights, version, promote=True):
        published.append((version, promote))
        return True

    assert asyncio.run(canary.deliver("/w/v2", 2, publish))["passed"]
    assert publisher.calls == [("hold_apart", 2), ("release", None)] and published == [(2, True)]

    alone, publisher, _, published, _ = promotion(tmp_path / "b", lora=False, answers={None: 0})
    assert asyncio.run(alone.deliver("/w/v2", 2, publish))["passed"]
    assert publisher.calls == [("hold_apart", 2), ("release", None)]
    assert published == [(2, False)]  # served before its verdict (one engine), promoted by the verdict


class FailsAfter(Engine):
    """Answers `calls` generations (the incumbent's), then the engine is unreachable (the candidate's)."""

    def __init__(self, calls: int):
        super().__init__()
        self.calls = calls

    async def generate(self, payload):
        self.fail = len(self.payloads) >= self.calls
        return await super().generate(payload)


def test_an_evaluation_that_fails_never_leaves_a_candidate_serving(tmp_path):
    async def deliver(case, *, lora=False, canary=False):
        promo, publisher, _, published, history = promotion(tmp_path / case, lora=lora, answers={}, canary=canary)
        promo.gate.engine = engine = FailsAfter(len(PROMPTS))  # the incumbent scores; the candidate cannot
        if canary:
            publisher.canary = engine

        async def publish(weights, version, promote=True):  # the learner's: the policy moves to what it publishes
            published.append((version, promote))
            promo.policy.version, promo.policy.weights_dir = version, weights
            return True
        return await promo.deliver("/w/v2", 2, publish), publisher, published, history, promo

    # One engine, full weights: v2 had to serve to be checked, and is rejected rather than left serving.
    verdict, publisher, published, history, promo = asyncio.run(deliver("alone"))
    assert published == [(2, False)] and verdict["passed"] is False and verdict["unevaluated"] is True
    assert "EngineUnavailable: connection refused" in verdict["detail"]
    assert history.get(2).gate["passed"] is False and promo.snapshot()["rejected"] == 1
    # A canary or a staged adapter: the candidate serves nowhere; the canary goes back; the evaluation is retried.
    for case, kw, calls in (("canary", {"canary": True}, [("hold_apart", 2), ("release", ("/w/v1", "1"))]),
                            ("lora", {"lora": True}, [("stage", 2), ("release", ("/w/v1", "1"))])):
        verdict, publisher, published, history, promo = asyncio.run(deliver(case, **kw))
        assert verdict is None and published == [] and publisher.calls == calls, case
        assert history.get(2).status == "candidate" and promo.snapshot()["failures"] == 1
