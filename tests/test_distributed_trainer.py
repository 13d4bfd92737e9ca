"""The trainer world (docs/ARCHITECTURE.md §13): FSDP2 on 2 gloo ranks under torchrun equals the
single-process trainer on the same global batch; checkpoints move between world sizes; a rank
that dies or hangs mid-step is recovered from the last checkpoint with no sample lost.

The comparisons run in one torchrun world (tests/distributed_step.py, ~30 s on 2 cores); the tests
below read what it measured. Tolerance: 1e-6 relative, per quantity, as asserted; the start-up is exact.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from clawd.trainer.worker.sharding import split_by_tokens
from tests.test_learner import until
from tests.test_trainer_writes import learning, ledger, put

REPO = Path(__file__).resolve().parent.parent
TOLERANCE = 1e-6


def test_the_batch_is_split_by_tokens_longest_first_to_the_lightest_rank():
    assert split_by_tokens([5, 100, 7, 60, 3, 40], 2) == [[1, 2], [0, 3, 4, 5]]  # 107 and 108 tokens
    assert split_by_tokens([10, 10, 10], 2) == [[0, 2], [1]]                    # ties: the lowest index, rank
    assert split_by_tokens([4], 3) == [[0], [], []]                             # a rank may get nothing
    assert split_by_tokens([], 2) == [[], []]
    lengths = [90, 9, 14, 6, 33, 21]
    shares = split_by_tokens(lengths, 2)
    assert sorted(sum(shares, [])) == list(range(6))
    assert [sum(lengths[i] for i in s) for s in shares] == [90, 83]


@pytest.fixture(scope="module")
def measured(tiny_model, tmp_path_factory) -> dict:
    work = tmp_path_factory.mktemp("world")
    out = work / "out.json"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}  # one torch thread per rank
    run = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--standalone",
                          str(REPO / "tests" / "distributed_step.py"), str(tiny_model), str(work / "state"), str(out)],
                         env=env, capture_output=True, text=True, timeout=600, cwd=REPO)
    assert run.returncode == 0, run.stderr[-4000:]
    return json.loads(out.read_text())


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["rl", "opd", "combine"])
@pytest.mark.parametrize("budget", [1, 256])
def test_a_step_on_two_ranks_equals_the_step_on_one(measured, mode, budget):
    """Loss, every parameter's whole gradient, the gradient norm and the weights after a step at lr 1e-2,
    for batches of 6 to 90 tokens: alone per forward (budget 1) and packed (256; the two ranks then also
    recompute each decoder layer in the backward, the one process does not)."""
    m = measured["modes"][f"{mode}/{budget}"]
    assert measured["world_size"] == 2 and m["params_with_grad"] == 26
    assert m["tokens"][0] == m["tokens"][1] == 74  # the diagnostics cover the whole batch on both
    assert m["recomputed"] == [budget == 256, False]
    assert m["loss_rel"] <= TOLERANCE
    assert m["grad_norm_rel"] <= TOLERANCE
    assert m["grad_rel_max"] <= TOLERANCE
    assert m["weights_rel_max"] <= TOLERANCE


def test_the_shipped_step_with_top_k_rows_on_two_ranks_equals_it_on_one(measured):
    """Two mini-batches and top-K OPD rows on the hinted samples: the ranks sum the same loss parts (one rank's
    share may hold no top-k rows), and the last update's gradients and the weights after match one process's."""
    m = measured["topk"]
    assert m["updates"] == [2, 2] and m["opd_topk"][1] != 0.0
    assert abs(m["loss"][0] - m["loss"][1]) <= TOLERANCE * abs(m["loss"][1])
    assert abs(m["opd_topk"][0] - m["opd_topk"][1]) <= TOLERANCE * abs(m["opd_topk"][1])
    # The second update starts from weights that already differ by rounding: its gradients within 1.1e-6 measured.
    assert m["grad_rel_max"] <= 2 * TOLERANCE and m["weights_rel_max"] <= TOLERANCE


def test_the_comparison_catches_gradients_averaged_over_ranks(measured):
    """The negative control: FSDP's default divides the summed gradients by the world size, on top of the
    whole batch's normaliser. Every gradient comes out halved, and the comparison says so."""
    control = measured["control"]
    assert control["grad_rel_max"] == pytest.approx(0.5, abs=1e-6)
    assert control["grad_norm"][0] == pytest.approx(control["grad_norm"][1] / 2, rel=1e-6)


def test_a_checkpoint_moves_between_world_sizes_and_format_1_still_loads(measured):
    assert measured["deferred_world"] == {"pending": [True, False], "equal": True}  # a deferred write in a world
    two_to_one = measured["reshard_2_to_1"]
    assert two_to_one["weights_equal"] and two_to_one["step"] == 1 and two_to_one["version"] == 1
    assert two_to_one["journal_position"] == {"segment": 1} and two_to_one["optimizer_steps"] == [1]
    assert two_to_one["next_step_rel_max"] <= TOLERANCE  # AdamW's moments came back too
    for name in ("reshard_1_to_2", "format1"):
        resumed = measured[name]
        assert resumed["weights_equal"] and resumed["step"] == 3, name
        assert resumed["next_step_rel_max"] <= TOLERANCE, name


def test_lora_adapters_train_publish_and_checkpoint_in_the_world(measured):
    """PEFT wraps the model before fully_shard: only the adapters get gradients, the same as one process's;
    the frozen base is untouched; the gathered adapter is the file one process publishes; the 2-rank
    checkpoint resumes alone."""
    lora = measured["lora"]
    assert lora["params_with_grad"] == lora["lora_params_with_grad"] == 28  # A and B on 14 modules, nothing else
    assert lora["base_unchanged"] and lora["published_tensors"] == 28
    for key in ("loss_rel", "grad_rel_max", "weights_rel_max", "published_rel_max"):
        assert lora[key] <= TOLERANCE, key
    assert lora["resumed_equal"] and lora["resumed_step"] == 1
    assert lora["init_equal"]  # the adapters' random init, broadcast from rank 0: one process's, bit for bit


def test_the_world_starts_from_rank_0s_load_bit_for_bit(measured):
    """Every rank builds the model on the meta device and only rank 0 reads the weights (clawd/trainer/
    sharded_load.py): each gathered parameter and buffer, the rotary inv_freq recomputed on each rank included,
    equals what from_pretrained loads alone, bit for bit; tied embeddings stay one parameter. The tests' Qwen2
    through the Trainer; a tiny Llama (tied, llama3 RoPE) and Qwen3 (untied) through the loader."""
    startup = measured["startup"]
    assert startup["qwen2"]["from_pretrained_calls"] == [1, 0]  # rank 1 never loads the model
    for name in ("qwen2", "tiny-llama", "tiny-qwen3"):
        m = startup[name]
        assert m["keys_equal"] and m["unequal"] == [] and m["tied"] and m["generation_config_equal"], name
        assert m["buffers"] == ["model.rotary_emb.inv_freq", "model.rotary_emb.original_inv_freq"], name


@pytest.mark.slow
@pytest.mark.parametrize("fault", ["kill", "hang", "oom"])
async def test_a_rank_that_dies_or_hangs_mid_step_is_recovered_with_no_sample_lost(tiny_model, tmp_path, fault_env,
                                                                                   monkeypatch, fault):
    """Rank 1 of 2 dies (SIGKILL), hangs or runs out of memory at its first forward. The world is torn down
    (torchrun stops the other rank, or its collective times out), the supervisor starts a new world from the
    last checkpoint and sends the batch again: one optimizer step for it, every sample trained once. Out of
    memory, rank 1 tells the coordinator, which tells the daemon ("oom", what rank 0 waiting in a collective
    could not): the batch comes back split, a step per half."""
    fault_env(f"trainer.step.forward={fault}@1")
    monkeypatch.setenv("CLAWD_FAULTS_RANKS", "1")
    async with learning(tiny_model, tmp_path, nproc_per_node=2, collective_timeout=5.0) as (learner, store, fake,
                                                                                              trainer):
        await fault_env.first_child_only(trainer)
        assert trainer.ready.world_size == 2
        await put(store, learner, 0, 1)  # one batch (rollout_batch_size 2)
        steps = 2 if fault == "oom" else 1
        await until(lambda: learner.policy.version == steps and store.depth == 0, timeout=240)
        assert trainer.restarts == 1 and trainer.state["step"] == steps and trainer.ready.world_size == 2
        assert learner.limits.oom_steps == (fault == "oom") and not learner.limits.excluded
    lines = sorted((x for x in ledger(tmp_path) if x["step"] >= 1), key=lambda x: x["step"])
    assert [(sorted(x["samples"]), x["version"]) for x in lines] == (
        [(["s0"], 1), (["s1"], 2)] if fault == "oom" else [(["s0", "s1"], 1)])
