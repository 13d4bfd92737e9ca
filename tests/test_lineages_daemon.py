"""Adapters per principal on a live daemon (the real CPU engine and trainer, LoRA): a principal who reaches
`adapter_min_samples` gets an adapter of their own, trained only on their samples and served only to them;
everyone else is served the shared one; `clawctl forget` deletes theirs and they are served the shared again."""
from __future__ import annotations

import json
import os
import signal
import time
import urllib.request

import openai
import pytest

from clawd.safety.versions import Versions
from clawd.weights import lineage_dir

from .harness import Daemon
from .test_clawctl import clawctl, status



def thanked(client: openai.OpenAI, user: str, text: str) -> None:
    """A conversation the user thanks, under the `user` field (the principal, with auth.trust_user_field)."""
    messages = [{"role": "user", "content": text}]
    reply = client.chat.completions.create(model="m", messages=messages, user=user)
    messages += [reply.choices[0].message.model_dump(exclude_none=True), {"role": "user", "content": "Thanks!"}]
    client.chat.completions.create(model="m", messages=messages, user=user, extra_headers={"X-Session-Done": "1"})


def wait(daemon: Daemon, what, timeout: float = 120):
    deadline = time.monotonic() + timeout
    while True:
        snap = status(daemon)
        if (found := what(snap)) is not None and found is not False:
            return found
        assert time.monotonic() < deadline, json.dumps({k: snap.get(k) for k in ("lineages", "policy", "queue")})
        time.sleep(0.2)


def served_version(daemon: Daemon, principal: str) -> int:
    """The policy version the principal's newest turn was served by."""
    return [r for r in daemon.records() if r["principal"] == principal][-1]["policy_version"]


def histories(state, lineages: dict) -> dict[str, set[int]]:
    """Each principal's own version numbers (their lineage's history), by principal."""
    return {p: {v.version for v in Versions(lineage_dir(state, ln["lineage"]) / "versions.jsonl",
                                            key_path=state / "principal.key") if v.version}
            for p, ln in lineages.items()}


@pytest.mark.slow
def test_a_principal_gets_their_own_adapter_and_loses_it_when_forgotten(tiny_model, tmp_path):
    """One daemon, one story (one daemon for the whole of it: each costs the suite a start of the engine and
    the trainer): alice qualifies and gets her own adapter, served to her alone; carol qualifies too and both
    learners step at the same moment, each version with its own number (the engine names an adapter by its
    number, so a number given twice would serve one principal the other's adapter); a restart finds alice's
    adapter again; `clawctl forget alice`, with the trainer down, deletes it and her numbers are never given
    again."""
    import concurrent.futures

    state = tmp_path / "state"
    sections = {
        "model": {"path": str(tiny_model), "max_tokens_cap": 4}, "engine": {"launch": "local"},
        # Principals named by the `user` field: a lineage is then found again only when its principal's samples
        # arrive, after the engine came up without its adapter (with API keys, at start).
        "auth": {"trust_user_field": True},
        "monitors": {"enabled": True},  # a watch over her own versions too
        "learner": {"enabled": True, "rollout_batch_size": 2, "min_batch_size": 2, "max_staleness": 8},
        "train": {"adapters": "per_principal", "adapter_min_samples": 3, "max_adapters": 4,
                  "lora": {"rank": 4, "alpha": 8.0, "lr": 1e-2}}}
    daemon = Daemon(tmp_path, sections)
    try:
        client = openai.OpenAI(base_url=daemon.url + "/v1", api_key="none", max_retries=0)
        for i in range(2):  # the shared learner may train on these: she has no adapter of her own yet
            thanked(client, "alice", f"Tell me about otters, part {i}")
        wait(daemon, lambda s: s["learner"]["samples_trained"] >= 2 or s["lineages"]["principals"])
        thanked(client, "alice", "Tell me about otters, again")  # she has qualified: this one waits for hers
        key = wait(daemon, lambda s: (s["lineages"]["principals"].get("alice") or {}).get("lineage"))
        for i in range(2):  # her next samples are hers alone
            thanked(client, "alice", f"Tell me about seals, part {i}")
        own = wait(daemon, lambda s: (s["lineages"]["principals"]["alice"]["version"] or None))
        snap = status(daemon)
        assert snap["lineages"]["principals"]["alice"]["adapter"] == f"clawd-v{own}"
        assert "bob" not in snap["lineages"]["principals"]
        with urllib.request.urlopen(daemon.url + "/metrics", timeout=10) as resp:
            assert "clawd_principal_adapters 1.0" in resp.read().decode()

        thanked(client, "alice", "And whales?")
        thanked(client, "bob", "Tell me about crabs")
        assert served_version(daemon, "alice") == own  # her adapter, to her alone
        assert served_version(daemon, "bob") == snap["policy"]["version"] != own

        # Her lineage's history: her versions, trained on her samples only; the shared one never saw those.
        history = Versions(lineage_dir(state, key) / "versions.jsonl", key_path=state / "principal.key")
        mine = [v for v in history if v.version > 0]
        assert mine and all(set(v.principals) == {key} for v in mine)
        shared = Versions(state / "versions.jsonl")
        assert own not in {v.version for v in shared}  # numbers are never shared between histories
        assert sum(v.principals.get(key, 0) for v in shared) <= 2  # at most the two before she qualified

        # Carol qualifies; then alice's and carol's batches fill at about the same time, again and again.
        for i in range(3):
            thanked(client, "carol", f"Hello {i}")
        wait(daemon, lambda s: (s["lineages"]["principals"].get("carol") or {}).get("lineage"))
        before = {p: ln["publishes"] for p, ln in status(daemon)["lineages"]["principals"].items()}
        with concurrent.futures.ThreadPoolExecutor(2) as pool:
            for _ in range(3):
                list(pool.map(lambda user: thanked(client, user, f"More, {user}"), ("alice", "carol")))
        both = wait(daemon, lambda s: all(s["lineages"]["principals"][p]["publishes"] >= before.get(p, 0) + 1
                                          for p in ("alice", "carol")) and s["lineages"]["principals"])
        own_versions = histories(state, both)
        shared_versions = {v.version for v in Versions(state / "versions.jsonl") if v.version}
        assert not own_versions["alice"] & own_versions["carol"], own_versions
        assert not (own_versions["alice"] | own_versions["carol"]) & shared_versions, (own_versions, shared_versions)
        assert clawctl(daemon, "pause").returncode == 0  # no version more while each is asked what serves them
        time.sleep(2)  # a step under way lands
        now = status(daemon)["lineages"]["principals"]
        for user in ("alice", "carol"):
            thanked(client, user, "Mine?")
            assert served_version(daemon, user) == now[user]["version"]
        assert now["alice"]["version"] != now["carol"]["version"]
        assert clawctl(daemon, "resume").returncode == 0
        own = now["alice"]["version"]

        # A restart finds her adapter again (its newest version the gate and checkpoints allow) and serves it
        # to her once the engine, which came up without it, holds it.
        assert daemon.stop() == 0
        daemon = Daemon(tmp_path, sections)
        client = openai.OpenAI(base_url=daemon.url + "/v1", api_key="none", max_retries=0)
        deadline = time.monotonic() + 90
        while True:  # her samples find her lineage; she is served the shared adapter until hers is loaded
            thanked(client, "alice", "Back again")
            again = (status(daemon)["lineages"]["principals"].get("alice") or {}).get("version")
            if again and served_version(daemon, "alice") == again:
                break
            assert time.monotonic() < deadline, status(daemon)["lineages"]
            time.sleep(0.3)
        assert again >= own
        mine = [v for v in Versions(lineage_dir(state, key) / "versions.jsonl",
                                    key_path=state / "principal.key") if v.version > 0]

        # Forgotten while no trainer holds her adapter (killed here; as after a restart, before it is ready):
        # the daemon deletes her lineage's files itself (they once stayed, reported removed, and a restart
        # would have found her adapter again).
        pid = wait(daemon, lambda s: s["trainer"]["alive"] and s["trainer"]["pid"])
        os.kill(pid, signal.SIGKILL)
        wait(daemon, lambda s: not s["trainer"]["alive"], timeout=30)
        shared_before = status(daemon)["policy"]["version"]
        done = json.loads(clawctl(daemon, "forget", "alice", "--json").stdout)
        assert not status(daemon)["trainer"]["alive"]  # it was forgotten without a trainer
        assert done["removed"]["own_adapter_versions"] >= len(mine)  # her learner may have published again
        assert not lineage_dir(state, key).exists()
        assert "alice" not in status(daemon)["lineages"]["principals"]
        # Her numbers are never given again, not even to the shared adapter (an engine may still hold hers).
        for user in ("dave", "erin"):  # one sample each: too few for their own adapter, so the shared one steps
            thanked(client, user, "More crabs")
        newest = wait(daemon, lambda s: s["policy"]["version"] if s["policy"]["version"] > shared_before else None)
        assert newest > max(v.version for v in mine)
        shared = {v.version for v in Versions(state / "versions.jsonl")}
        assert not shared & {v.version for v in mine}, (shared, mine)
    finally:
        assert daemon.stop() == 0
