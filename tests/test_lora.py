"""LoRA mode: the trainer trains PEFT adapters on a frozen base, publishes adapter directories, resumes
exactly, and the frozen reference is the base; the daemon serves the adapters on the CPU engine without a
failed request across publishes; a merged export gives the adapter's log-probs."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from clawd.train_config import TrainConfig
from clawd.trainer.step import Trainer

from .test_trainer import REPO, mixed_batch, sample

LORA = dict(lora_rank=4, lora_alpha=8.0, lora_lr=1e-2, seed=3)


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
        assert not metrics["skipped"] and metrics["lr"] == LORA["lora_lr"]
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
    assert sorted(config["target_modules"]) == sorted(TrainConfig().lora_target_modules)


def test_lora_rank_0_is_the_full_fine_tune(tiny_model, tmp_path):
    """The LoRA keys change nothing while lora_rank is 0: the same step, the same weights, a model directory."""
    plain = Trainer(tiny_model, tmp_path / "a", TrainConfig(lr=1e-3))
    zero = Trainer(tiny_model, tmp_path / "b", TrainConfig(lr=1e-3, lora_rank=0, lora_alpha=3.0, lora_lr=0.5,
                                                          lora_target_modules=("q_proj",)))
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
    trainer = Trainer(tiny_model, tmp_path / "lora", TrainConfig(**LORA, kl_loss_coef=0.1))
    assert trainer.ref_scorer is None  # no second copy of the weights
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


def test_an_exported_merged_model_gives_the_adapters_logprobs(tiny_model, tmp_path):
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
    run = lambda *args: subprocess.run([sys.executable, str(REPO / "bin" / "clawctl"), "--config", str(config),
                                        *args], capture_output=True, text=True, timeout=120)
    done = run("export-model", "1", str(tmp_path / "merged"))
    assert done.returncode == 0, done.stderr
    merged = tmp_path / "merged"
    assert (merged / "config.json").is_file() and (merged / "tokenizer.json").is_file()
    assert not (merged / "adapter_config.json").exists()
    got = Trainer(merged, tmp_path / "check", TrainConfig()).logprobs(probe)
    assert max(abs(x - y) for a, b in zip(want, got) for x, y in zip(a, b)) <= 1e-5

    missing = run("export-model", "7", str(tmp_path / "other"))
    assert missing.returncode == 1 and "v7 is not in" in missing.stderr and "kept versions: v1" in missing.stderr
    again = run("export-model", "1", str(merged))
    assert again.returncode == 1 and "already exists" in again.stderr


# --- the daemon in LoRA mode -------------------------------------------------------------------

async def test_the_daemon_serves_each_adapter_and_asks_the_base_as_reference(tiny_model, tmp_path, caplog):
    """In-process daemon, fake SGLang with --enable-lora, the real trainer: a publish loads the version's
    adapter and only then do chat requests carry it; the teacher (the reference) is asked with no adapter,
    so it scores with the base; the previous adapter is unloaded once nothing uses it; no reference engine."""
    import asyncio
    import logging

    import openai

    from clawd.config import config_from_dict
    from clawd.daemon import Shutdown, run

    from .fake_sglang import FakeSGLang
    from .test_daemon import _listening

    caplog.set_level(logging.INFO, logger="clawd")
    targets = list(TrainConfig().lora_target_modules)
    async with FakeSGLang(tokens=6, enable_lora=True, max_lora_rank=4, lora_target_modules=targets) as fake:
        cfg = config_from_dict({
            "server": {"port": 0}, "state": {"dir": str(tmp_path / "state"), "min_free_bytes": 0},
            "model": {"path": str(tiny_model)},
            "engine": {"launch": "none", "url": fake.url, "health_interval": 0.2},
            "scoring": {"mode": "combine"}, "judge": {"backend": "rules", "teacher_engine": "reference"},
            "learner": {"enabled": True, "rollout_batch_size": 1, "min_batch_size": 1},
            "train": {"lora_rank": 4, "lora_alpha": 8.0}})
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
    assert all(Path(b["lora_path"], "adapter_config.json").is_file() for b in loads)
    assert not [p for p, _ in fake.calls if p in ("/update_weights_from_disk", "/pause_generation")]
    chat = [(rid, adapter) for rid, adapter in fake.lora_used if not rid.startswith("teacher-")]
    teacher = [(rid, adapter) for rid, adapter in fake.lora_used if rid.startswith("teacher-")]
    assert [a for _, a in chat[:2]] == [None, None]           # v0: the base
    assert [a for _, a in chat[2:4]] == ["clawd-v1"] * 2      # the second conversation, on v1
    assert fake.lora_used[before:] and teacher and all(a is None for _, a in teacher)  # the base is the reference


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
