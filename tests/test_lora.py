"""LoRA mode: the trainer trains PEFT adapters on a frozen base, publishes adapter directories, resumes
exactly, and the frozen reference is the base; the daemon serves the adapters on the CPU engine without a
failed request across publishes; a merged export gives the adapter's log-probs."""
from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from clawd.config.train import LoraConfig, LossConfig, OptimizerConfig, TrainConfig
from clawd.trainer.worker.step import Trainer

from .harness import Daemon
from .load import load_until_published, publish_windows
from .test_trainer import REPO, mixed_batch, sample

LORA = dict(lora=LoraConfig(rank=4, alpha=8.0, lr=1e-2), seed=3)
PUBLISHES = 5


def adapters_of(trainer: Trainer) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in trainer.model.named_parameters() if p.requires_grad}


def base_of(trainer: Trainer) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in trainer.model.state_dict().items() if "lora_" not in k}


def batches(n: int) -> list[list]:
    return [[sample(10 * i + j, 9 + 3 * j, 4, reward=(-1.0) ** (i + j), hint=j == 1) for j in range(3)]
            for i in range(n)]


def test_a_lora_step_changes_only_the_adapters(tiny_model, tmp_path):
    trainer = Trainer(tiny_model, tmp_path / "state", TrainConfig(**LORA))
    base, before = base_of(trainer), adapters_of(trainer)
    assert before and all("lora_" in n for n in before)
    assert {id(p) for p in trainer.params} == {id(p) for p in trainer.model.parameters() if p.requires_grad}
    for batch in batches(2):
        metrics = trainer.train_step(batch, "combine")
        assert not metrics["skipped"] and metrics["lr"] == LORA["lora"].lr
    after = base_of(trainer)
    assert after.keys() == base.keys() and all(torch.equal(after[k], base[k]) for k in base)  # bit for bit
    moved = adapters_of(trainer)
    assert all(not torch.equal(moved[n], before[n]) for n in before if ".lora_B." in n)
    # AdamW holds state for the adapters alone.
    assert len(trainer.optimizer.state) == len(before)

    dest = trainer.publish(1)
    assert sorted(p.name for p in dest.iterdir()) == ["adapter_config.json", "adapter_model.safetensors"]
    config = json.loads((dest / "adapter_config.json").read_text())
    assert (config["r"], config["lora_alpha"], config["lora_dropout"]) == (4, 8.0, 0.0)
    assert sorted(config["target_modules"]) == sorted(TrainConfig().lora.target_modules)


def test_lora_rank_0_is_the_full_fine_tune(tiny_model, tmp_path):
    """The LoRA keys change nothing while lora_rank is 0: the same step, the same weights, a model directory."""
    plain = Trainer(tiny_model, tmp_path / "a", TrainConfig(optimizer=OptimizerConfig(lr=1e-3)))
    zero = Trainer(tiny_model, tmp_path / "b", TrainConfig(optimizer=OptimizerConfig(lr=1e-3),
                                                           lora=LoraConfig(rank=0, alpha=3.0, lr=0.5,
                                                                           target_modules=("q_proj",))))
    assert type(zero.model) is type(plain.model) and "Peft" not in type(zero.model).__name__
    for batch in batches(2):
        assert plain.train_step(batch, "combine")["loss"] == zero.train_step(batch, "combine")["loss"]
    a, b = plain.model.state_dict(), zero.model.state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert (zero.publish(1) / "config.json").is_file()


def test_lora_resume_is_exact_and_the_checkpoint_holds_only_the_adapters(tiny_model, tmp_path):
    steps = batches(4)
    straight = Trainer(tiny_model, tmp_path / "straight", TrainConfig(**LORA))
    whole = [straight.train_step(b, "combine")["loss"] for b in steps]

    first = Trainer(tiny_model, tmp_path / "split", TrainConfig(**LORA))
    head = [first.train_step(b, "combine")["loss"] for b in steps[:2]]
    first.publish(1)
    ckpt = first.checkpoint(journal_position=2)
    del first
    second = Trainer(tiny_model, tmp_path / "split", TrainConfig(**LORA))
    assert (second.step, second.weights_version, second.journal_position) == (2, 1, 2)
    tail = [second.train_step(b, "combine")["loss"] for b in steps[2:]]

    assert head + tail == whole  # exact float equality
    a, b = adapters_of(straight), adapters_of(second)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)

    import torch.distributed.checkpoint as dcp
    saved = dcp.FileSystemReader(str(ckpt / "dcp")).read_metadata().state_dict_metadata
    weights = [k for k in saved if k.startswith("model.")]
    assert weights and all("lora_" in k for k in weights)  # the frozen base is model.path's, never copied
    # A trainer of another shape refuses the checkpoint rather than loading half of it.
    with pytest.raises(ValueError, match="LoRA off"):
        Trainer(tiny_model, tmp_path / "split", TrainConfig())


def test_the_reference_in_lora_mode_is_the_base_model(tiny_model, tmp_path):
    """The reference log-probs (the KL term's) are the base model's, however far the adapters moved, and
    the KL term starts at 0 (PEFT's B starts at zero: step 1's policy is the base)."""
    base = Trainer(tiny_model, tmp_path / "base", TrainConfig())
    trainer = Trainer(tiny_model, tmp_path / "lora", TrainConfig(**LORA, ppo_mini_batches=1,
                                                                 loss=LossConfig(kl_coef=0.1)))
    probe = mixed_batch()
    first = trainer.train_step(batches(1)[0], "combine")
    assert first["loss_kl"] == 0.0
    for batch in batches(3)[1:]:
        last = trainer.train_step(batch, "combine")
    assert last["loss_kl"] > 0
    want = base.logprobs(probe)
    ref, policy = trainer.logprobs(probe, reference=True), trainer.logprobs(probe)
    assert max(abs(x - y) for a, b in zip(want, ref) for x, y in zip(a, b)) <= 1e-6
    assert max(abs(x - y) for a, b in zip(want, policy) for x, y in zip(a, b)) > 1e-3  # the adapters did move


def test_an_exported_merged_model_gives_the_adapters_logprobs(tiny_model, tmp_path, capsys):
    """`clawctl export-model` (offline, from the config's state directory) merges the adapter into the base:
    the merged model, loaded as a plain model, scores as the base with the adapter did."""
    state = tmp_path / "state"
    trainer = Trainer(tiny_model, state, TrainConfig(**LORA))
    for batch in batches(2):
        trainer.train_step(batch, "combine")
    trainer.publish(1)
    probe = mixed_batch()
    want = trainer.logprobs(probe)

    config = tmp_path / "clawd.toml"
    config.write_text(f'[model]\npath = "{tiny_model}"\n[state]\ndir = "{state}"\n[train]\nlora_rank = 4\n')
    def run(*args: str) -> subprocess.CompletedProcess:  # clawctl's main, in this process (torch is loaded here)
        from clawd.ops.ctl import main
        code = main(["--config", str(config), *args])
        out = capsys.readouterr()
        return subprocess.CompletedProcess(args, code, out.out, out.err)

    done = run("export-model", "1", str(tmp_path / "merged"))
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == f"v1 exported to {tmp_path / 'merged'}"
    merged = tmp_path / "merged"
    assert (merged / "config.json").is_file() and (merged / "tokenizer.json").is_file()
    assert not (merged / "adapter_config.json").exists()
    got = Trainer(merged, tmp_path / "check", TrainConfig()).logprobs(probe)
    assert max(abs(x - y) for a, b in zip(want, got) for x, y in zip(a, b)) <= 1e-5

    missing = run("export-model", "7", str(tmp_path / "other"))
    assert missing.returncode == 1 and "v7 is not in" in missing.stderr and "kept versions: v1" in missing.stderr
    again = run("export-model", "1", str(merged))
    assert again.returncode == 1 and "already exists" in again.stderr
    # bin/clawctl itself: the command is there, and a refusal needs no torch.
    cli = subprocess.run([sys.executable, str(REPO / "bin" / "clawctl"), "--config", str(config), "export-model",
                          "9", str(tmp_path / "none")], capture_output=True, text=True, timeout=60)
    assert cli.returncode == 1 and "v9 is not in" in cli.stderr



async def test_the_cpu_engine_serves_the_adapters_logprobs_and_the_base_as_reference(tiny_model, tmp_path):
    """Exact token capture in LoRA mode: the CPU engine's log-probs for a request carrying a published
    adapter are the trainer's for the same tokens, and a request carrying none gets the base's, which is
    the trainer's reference (adapters off)."""
    import dataclasses

    import aiohttp

    from clawd.engine.local.scheduler import Engine
    from clawd.engine.local.server import parse_args

    from .local_engine import running

    trainer = Trainer(tiny_model, tmp_path / "state", TrainConfig(**LORA))
    for batch in batches(2):
        trainer.train_step(batch, "combine")
    adapter = trainer.publish(1)
    args = parse_args(["--model", str(tiny_model), "--threads", "1", *TrainConfig(**LORA).lora.flags()])
    async with running(Engine(args)) as url, aiohttp.ClientSession() as http:
        async def post(path: str, body: dict) -> dict:
            async with http.post(url + path, json=body) as resp:
                assert resp.status == 200, await resp.text()
                return await resp.json()

        await post("/load_lora_adapter", {"lora_name": "clawd-v1", "lora_path": str(adapter)})
        prompt = sample(7, 12, 1).tokens[:11]
        served = {}
        for name in ("clawd-v1", None):
            body = {"input_ids": prompt, "return_logprob": True,
                    "sampling_params": {"max_new_tokens": 8, "temperature": 1.0, "ignore_eos": True}}
            if name:
                body["lora_path"] = name
            out = await post("/generate", body)
            served[name] = (out["output_ids"], [e[0] for e in out["meta_info"]["output_token_logprobs"]])
    for name, (ids, engine_lps) in served.items():
        s = dataclasses.replace(sample(7, 12, 1), sample_id=f"x{name}", tokens=prompt + ids, response_length=len(ids),
                                loss_mask=[1] * len(ids), rollout_logprobs=engine_lps, temperature=1.0)
        (trained,) = trainer.logprobs([s], reference=name is None)
        assert max(abs(a - b) for a, b in zip(trained, engine_lps)) <= 1e-5, name
    assert served["clawd-v1"] != served[None]  # the adapter changed what was sampled or its log-probs


async def test_a_rolling_adapter_publish_and_the_retired_adapters_unload(tmp_path):
    """Two fake SGLang replicas: a publish loads the adapter on each (nothing paused), a replica whose load
    fails is realigned with it once the policy moved; calls on "policy" carry the adapter, on the reference
    none; a retired adapter is unloaded only once the last request carrying it has ended."""
    import asyncio

    from clawd.config.loading import config_from_dict
    from clawd.engine.client import EngineClient
    from clawd.engine.lora import AdapterUse
    from clawd.engine.replicas import Balanced, Replicas
    from clawd.engine.supervisor import EngineSupervisor
    from clawd.learning.publisher import Publisher
    from clawd.served import Policy

    from .fake_sglang import FakeSGLang

    targets = list(TrainConfig().lora.target_modules)
    for v in (1, 2):
        (tmp_path / f"v{v}").mkdir()
        (tmp_path / f"v{v}" / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": 4,
                                                                             "target_modules": targets}))
    lora = dict(enable_lora=True, max_lora_rank=4, lora_target_modules=targets)
    async with FakeSGLang(**lora) as a, FakeSGLang(**lora) as b:
        cfg = config_from_dict({"engine": {"launch": "none", "urls": [a.url, b.url], "health_interval": 0.1},
                                "train": {"lora": {"rank": 4}}})
        policy = Policy()
        sups = [EngineSupervisor(cfg, EngineClient(f.url), "policy", policy, index=i) for i, f in enumerate((a, b))]
        for sup in sups:
            await sup.client.start()
        tasks = [asyncio.create_task(sup.run()) for sup in sups]
        adapters = AdapterUse(policy)
        replicas = Replicas(sups, policy)
        publisher = Publisher(replicas, 10, adapters=adapters)
        unloader = asyncio.create_task(adapters.unload_retired(replicas, 10))

        def promote(version: int) -> None:  # what the learner does once a publish returns
            retired = policy.adapter
            policy.version, policy.weight_version = version, str(version)
            policy.weights_dir, policy.adapter = str(tmp_path / f"v{version}"), publisher.adapter_of(version)
            publisher.retire(retired)

        async def until(check, timeout: float = 5.0) -> None:
            deadline = asyncio.get_running_loop().time() + timeout
            while not check():
                assert asyncio.get_running_loop().time() < deadline
                await asyncio.sleep(0.02)

        try:
            for sup in sups:
                await asyncio.wait_for(sup.ready.wait(), 10)
            assert await publisher.publish(str(tmp_path / "v1"), 1) == 0.0  # nothing held
            promote(1)
            assert [p for p, _ in a.calls] == [p for p, _ in b.calls] == ["/continue_generation",
                                                                           "/load_lora_adapter"]
            assert [s.served_version for s in sups] == ["1", "1"] and a.weight_version == "0"
            await Balanced(replicas, adapters).generate({"input_ids": [5, 6], "rid": "on-policy",
                                                         "sampling_params": {"max_new_tokens": 2}})
            await Balanced(replicas).generate({"input_ids": [5, 6], "rid": "reference",
                                               "sampling_params": {"max_new_tokens": 2}})
            used = dict(a.lora_used + b.lora_used)
            assert (used["on-policy"], used["reference"]) == ("clawd-v1", None)

            held = adapters.begin()  # a chat request still running on clawd-v1
            b.fail_next(400, {"success": False, "error_message": "disk"}, path="/load_lora_adapter")
            await publisher.publish(str(tmp_path / "v2"), 2)
            assert sups[1].needs_realign and not replicas.usable(1) and replicas.usable(0)
            promote(2)
            await until(lambda: replicas.usable(1))
            assert b.lora_adapters.keys() == {"clawd-v1", "clawd-v2"}  # realigned; clawd-v1 still in use
            await asyncio.sleep(0.2)
            assert "clawd-v1" in a.lora_adapters and adapters.retired == {"clawd-v1": {0, 1}}
            adapters.end(held)
            await until(lambda: not adapters.retired)
            assert a.lora_adapters.keys() == b.lora_adapters.keys() == {"clawd-v2"} and adapters.unloaded == 2
        finally:
            unloader.cancel()
            for sup in sups:
                await sup.stop()
            for t in tasks:
                t.cancel()
            for sup in sups:
                await sup.client.close()


# --- the daemon in LoRA mode -------------------------------------------------------------------

@pytest.mark.slow
async def test_the_daemon_serves_each_adapter_and_asks_the_base_as_reference(tiny_model, tmp_path, caplog):
    """In-process daemon, fake SGLang with --enable-lora, the real trainer: a publish loads the version's
    adapter, the gate asks it by name, and only then do chat requests carry it; the teacher (the reference)
    is asked with no adapter,
    so it scores with the base; the previous adapter is unloaded once nothing uses it; no reference engine."""
    import asyncio
    import logging

    import openai

    from clawd.config.loading import config_from_dict
    from clawd.daemon import Shutdown, run

    from .fake_sglang import FakeSGLang
    from .test_daemon import _listening

    caplog.set_level(logging.INFO, logger="clawd")
    targets = list(TrainConfig().lora.target_modules)
    async with FakeSGLang(tokens=6, enable_lora=True, max_lora_rank=4, lora_target_modules=targets) as fake:
        cfg = config_from_dict({
            "server": {"port": 0}, "state": {"dir": str(tmp_path / "state"), "min_free_bytes": 0},
            "model": {"path": str(tiny_model)},
            "engine": {"launch": "none", "url": fake.url, "health_interval": 0.2},
            "scoring": {"mode": "combine"}, "judge": {"backend": "rules", "teacher_engine": "reference"},
            "learner": {"enabled": True, "rollout_batch_size": 1, "min_batch_size": 1},
            # the raw reward: a batch of one would centre on its own reward and take no step
            "train": {"lora": {"rank": 4, "alpha": 8.0}, "loss": {"reward_baseline": "none"}}})
        assert not cfg.reference_engine_needed
        shutdown = Shutdown()
        running = asyncio.create_task(run(cfg, shutdown))
        url = await _listening(caplog, running)
        client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="none", max_retries=5)

        async def conversation(text: str, reply_to_it: str) -> None:
            messages = [{"role": "user", "content": text}]
            first = await client.chat.completions.create(model="m", messages=messages)
            messages += [first.choices[0].message.model_dump(exclude_none=True),
                         {"role": "user", "content": reply_to_it}]
            await client.chat.completions.create(model="m", messages=messages, extra_headers={"X-Session-Done": "1"})

        async def until(check, what: str, timeout: float = 90) -> None:
            for _ in range(int(timeout / 0.1)):
                if await check():
                    return
                assert not running.done(), running
                await asyncio.sleep(0.1)
            raise TimeoutError(what)

        await until(lambda: _ready(url), "the daemon never became ready")
        await conversation("What is the capital of Italy?", "Thanks, that's perfect.")  # +1: a step, v1
        await until(lambda: _at_least(url, 1), "v1 was never published")
        before = len(fake.lora_used)
        await conversation("Name a prime number.",
                           "No, that's wrong: name a prime number larger than ten, such as thirteen.")  # hint
        await until(lambda: _at_least(url, 2), "v2 was never published")
        await until(lambda: _unloaded(fake, "clawd-v1"), "clawd-v1 was never unloaded")
        await client.close()
        shutdown.request()
        assert await asyncio.wait_for(running, 60) == 0

    loads = [body for path, body in fake.calls if path == "/load_lora_adapter"]
    assert [b["lora_name"] for b in loads] == ["clawd-v1", "clawd-v2"]
    restarted = await _restart_serves_the_checkpointed_adapter(cfg, caplog, targets)
    assert [b["lora_name"] for p, b in restarted.calls if p == "/load_lora_adapter"] == ["clawd-v2"]
    assert [a for _, a in restarted.lora_used] == ["clawd-v2"]  # the one chat request, on the restored version
    assert all(Path(b["lora_path"], "adapter_config.json").is_file() for b in loads)
    assert not [p for p, _ in fake.calls if p in ("/update_weights_from_disk", "/pause_generation")]
    chat = [(rid, adapter) for rid, adapter in fake.lora_used if not rid.startswith(("teacher-", "gate-"))]
    teacher = [(rid, adapter) for rid, adapter in fake.lora_used if rid.startswith("teacher-")]
    # The gate asked each candidate by name before any chat request carried it, and v0 as the base.
    assert {a for rid, a in fake.lora_used if rid.startswith("gate-")} == {None, "clawd-v1", "clawd-v2"}
    assert next(rid for rid, a in fake.lora_used if a == "clawd-v1").startswith("gate-")
    assert [a for _, a in chat[:2]] == [None, None]           # v0: the base
    assert [a for _, a in chat[2:4]] == ["clawd-v1"] * 2      # the second conversation, on v1
    assert fake.lora_used[before:] and teacher and all(a is None for _, a in teacher)  # the base is the reference


@pytest.mark.slow
def test_five_adapter_publishes_under_load_fail_no_request(tiny_model, tmp_path):
    """LoRA mode on the CPU engine: each publish loads the new adapter beside the old one, nothing is paused,
    requests already running finish on the adapter they started with, and no request fails. The overlap:
    served requests were in flight across every publish's window (the learner's line gives its span)."""
    daemon = Daemon(tmp_path, {"model": {"path": str(tiny_model), "max_tokens_cap": 8},
                               "engine": {"launch": "local"},
                               "learner": {"enabled": True, "rollout_batch_size": 1, "min_batch_size": 1},
                               "train": {"lora": {"rank": 4, "lr": 1e-3}}})
    try:
        requests, learner = load_until_published(daemon, users=4, publishes=PUBLISHES, timeout=240)
        # The users have stopped and their requests ended: every retired adapter is unloaded soon after (the
        # learner may still publish what was already scored, retiring more on the way).
        import time
        import urllib.request
        deadline = time.monotonic() + 60
        while True:
            snapshot = daemon.get("/debug/process")[1]
            with urllib.request.urlopen(snapshot["replicas"][0]["url"] + "/v1/models", timeout=10) as resp:
                held = [c["id"] for c in json.loads(resp.read())["data"] if c.get("parent")]
            if held == [snapshot["adapters"]["serving"]] and not snapshot["adapters"]["retired"]:
                break
            assert time.monotonic() < deadline, (held, snapshot["adapters"])
            time.sleep(0.2)
        with urllib.request.urlopen(daemon.url + "/metrics", timeout=10) as resp:
            metrics = resp.read().decode()
    finally:
        assert daemon.stop() == 0
    failures = [r["error"] for r in requests if not r["ok"]]
    ok = len(requests) - len(failures)
    assert learner["publishes"] >= PUBLISHES and learner["failed_publishes"] == 0
    assert failures == [] and ok > 2 * PUBLISHES
    windows = publish_windows(daemon.lines)[:PUBLISHES]
    assert len(windows) == PUBLISHES and all(w["intake_held_s"] == 0 for w in windows)  # nothing paused
    during = {w["version"]: [r for r in requests if r["ok"] and r["start"] < w["end"] and r["end"] > w["start"]]
              for w in windows}
    print(f"\n{ok} requests served; in flight during each adapter publish: "
          f"{({v: len(rs) for v, rs in during.items()})}; adapters the engine holds once idle: {held}")
    assert all(during.values()), {v: len(rs) for v, rs in during.items()}
    loaded = [line for line in daemon.lines if "LoRA adapter clawd-v" in line and " loaded from " in line]
    assert len(loaded) >= PUBLISHES and not any("generation paused" in line for line in daemon.lines)
    # Turns were served by several adapters (the last publishes can come close together under load: their
    # versions may serve no finished session before the users stop).
    versions = sorted({t["policy_version"] for t in daemon.records()})
    assert versions[0] == 0 and len(versions) >= 3, versions
    # Retired adapters were unloaded once unused (above: the engine ends up holding the served one alone).
    assert any(line for line in daemon.lines if "LoRA adapter clawd-v1 unloaded" in line)
    adapters = snapshot["adapters"]  # status and metrics say the same
    assert adapters["unloaded"] >= PUBLISHES - 1 and adapters["failed_unloads"] == 0
    scraped = re.search(r"^clawd_adapter_unloads_total (\S+)$", metrics, re.MULTILINE)  # scraped just after
    assert scraped and float(scraped.group(1)) >= adapters["unloaded"], metrics[-2000:]

async def _restart_serves_the_checkpointed_adapter(cfg, caplog, targets):
    """clawd again on the same state, before a fresh engine that holds no adapter: the policy is the checkpoint's
    version, and its adapter is loaded before the engine counts as ready."""
    import asyncio
    import dataclasses

    import openai

    from clawd.daemon import Shutdown, run

    from .fake_sglang import FakeSGLang
    from .test_daemon import _listening

    caplog.clear()
    async with FakeSGLang(tokens=6, enable_lora=True, max_lora_rank=4, lora_target_modules=targets) as fake:
        again = dataclasses.replace(cfg, engine=dataclasses.replace(cfg.engine, url=fake.url),
                                    learner=dataclasses.replace(cfg.learner, enabled=False))
        shutdown = Shutdown()
        running = asyncio.create_task(run(again, shutdown))
        url = await _listening(caplog, running)
        for _ in range(300):
            if await _ready(url):
                break
            await asyncio.sleep(0.1)
        assert (await _get(url, "/ready"))["policy_version"] == 2
        client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="none", max_retries=5)
        await client.chat.completions.create(model="m", messages=[{"role": "user", "content": "Hello again."}])
        await client.close()
        shutdown.request()
        assert await asyncio.wait_for(running, 60) == 0
    return fake


async def _get(url: str, path: str) -> dict:
    import asyncio
    import urllib.request

    def fetch():
        try:
            with urllib.request.urlopen(url + path, timeout=5) as resp:
                return json.loads(resp.read())
        except urllib.error.HTTPError as exc:
            return json.loads(exc.read())
    return await asyncio.to_thread(fetch)


async def _ready(url: str) -> bool:
    return bool((await _get(url, "/ready")).get("ready"))


async def _at_least(url: str, version: int) -> bool:
    return (await _get(url, "/ready")).get("policy_version", 0) >= version


async def _unloaded(fake, name: str) -> bool:
    return any(p == "/unload_lora_adapter" and b.get("lora_name") == name for p, b in fake.calls)
