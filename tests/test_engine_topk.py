"""The CPU engine's `top_logprobs_num` and `token_ids_logprob` rows (SGLang 0.5.23, /work notes §1-§5,
docs/ARCHITECTURE.md §10): the pure helpers on exact values, then the engine (in this process, tiny
model) against a direct forward pass of the same model. The shape rules common to SGLang's fake are
in test_sglang_conformance.py."""
from __future__ import annotations

import json
import math

import aiohttp
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from clawd.engine.local.logprob_rows import FLOOR, id_pairs, select_rows, top_pairs
from clawd.engine.local.sampling import next_token_row, pick_token, prompt_rows
from clawd.engine.local.scheduler import Engine
from clawd.engine.local.server import parse_args
from clawd.engine.local.wire import FLAT_IDS, ContractError, RequestError, parse_generate, parse_sampling_params
from tests.local_engine import running

INF = math.inf


# --------------------------------------------------------------------------
# Pure parts

def test_top_pairs_sort_descending_with_the_lowest_id_first_on_ties():
    rows = torch.tensor([[0.0, -1.0, -0.5, -0.5, -INF],
                         [-2.0, -1.0, -1.0, -1.0, -3.0],  # the 2nd place is shared by ids 1, 2 and 3
                         [-INF, -INF, -1.0, -INF, -INF]])
    assert top_pairs(rows, 3) == [[[0.0, 0], [-0.5, 2], [-0.5, 3]],
                                  [[-1.0, 1], [-1.0, 2], [-1.0, 3]],
                                  [[-1.0, 2], [FLOOR, 0], [FLOOR, 1]]]  # -inf clamped, ties by id
    assert top_pairs(rows[1:2], 2) == [[[-1.0, 1], [-1.0, 2]]]
    assert top_pairs(rows[:1], 5) == [[[0.0, 0], [-0.5, 2], [-0.5, 3], [-1.0, 1], [FLOOR, 4]]]


def test_id_pairs_keep_the_request_order_and_duplicates():
    rows = torch.tensor([[-0.25, -INF, -3.0], [-1.0, -2.0, -0.5]])
    assert id_pairs(rows, (2, 0, 2, 1)) == [[[-3.0, 2], [-0.25, 0], [-3.0, 2], [FLOOR, 1]],
                                             [[-0.5, 2], [-1.0, 0], [-0.5, 2], [-2.0, 1]]]
    assert select_rows(rows, 0, None) == ([], [])
    assert select_rows(rows[:0], 2, (1,)) == ([], [])
    assert select_rows(rows[1:], 1, (1,)) == ([[[-0.5, 2]]], [[[-2.0, 1]]])
    assert json.dumps(FLOOR) == "-3.4028234663852886e+38"  # finite: JSON, unlike -Infinity


def test_the_rows_the_sampler_and_the_prompt_hand_over():
    logits = torch.tensor([1.0, 3.0, 2.0, -1.0])
    biased = logits + torch.tensor([0.0, 0.0, 1.5, 0.0])
    gen = torch.Generator().manual_seed(0)
    greedy = parse_sampling_params({"temperature": 0, "logit_bias": {"2": 1.5}})
    tok, lp, row = pick_token(logits, greedy, [0], [], [], gen)
    assert tok == 2 and torch.equal(row, torch.log_softmax(biased, -1)) and lp == row[2].item()
    hot = parse_sampling_params({"temperature": 0.5, "logit_bias": {"2": 1.5}})
    tok, lp, row = pick_token(logits, hot, [0], [], [1], gen)  # id 1 banned: -inf in the row, never drawn
    expected = torch.log_softmax(torch.where(torch.arange(4) == 1, -INF, biased) / 0.5, -1)
    assert tok != 1 and torch.equal(row, expected) and lp == row[tok].item()
    # prefill only: T = 1 whatever the temperature, bias and penalties applied
    assert torch.equal(next_token_row(logits, hot, [0]), torch.log_softmax(biased, -1))
    penalised = parse_sampling_params({"repetition_penalty": 2.0})
    assert torch.equal(next_token_row(logits, penalised, [1]),
                       torch.log_softmax(torch.tensor([1.0, 1.5, 2.0, -1.0]), -1))
    window = torch.tensor([[0.0, 1.0], [2.0, 0.0], [5.0, 5.0]])  # positions 1, 2, 3 of a 4-id prompt
    assert torch.equal(prompt_rows(window, 4, 1), torch.log_softmax(window[:2], -1))
    assert prompt_rows(window[2:], 4, 3).shape == (0, 2) and prompt_rows(window[:0], 4, 4).shape == (0, 2)


def parse(**body):
    return parse_generate({"input_ids": [1, 2], **body}, tokenize=None)[0]


def test_token_ids_logprob_and_top_logprobs_num_parse_as_sglang_does():
    item, = parse(return_logprob=True, token_ids_logprob=[5, 3, 5], top_logprobs_num=4)
    assert (item.top_logprobs_num, item.token_ids_logprob, item.logprob_ids) == (4, (5, 3, 5), (5, 3, 5))
    # without return_logprob both are ignored (the ids are kept: SGLang still checks them)
    item, = parse(token_ids_logprob=[5], top_logprobs_num=4)
    assert (item.top_logprobs_num, item.token_ids_logprob, item.logprob_ids, item.wants_rows) == (0, (5,), None, False)
    item, = parse(return_logprob=True, token_ids_logprob=[], top_logprobs_num=-3)
    assert (item.top_logprobs_num, item.token_ids_logprob, item.wants_rows) == (0, None, False)
    a, b = parse_generate({"input_ids": [[1], [2]], "return_logprob": True, "token_ids_logprob": [7, 8]}, None)[0]
    assert a.token_ids_logprob == b.token_ids_logprob == (7, 8)
    a, b = parse_generate({"input_ids": [[1], [2]], "return_logprob": True, "token_ids_logprob": [[7], []],
                           "top_logprobs_num": [2, 0]}, None)[0]
    assert (a.token_ids_logprob, b.token_ids_logprob, a.top_logprobs_num, b.top_logprobs_num) == ((7,), None, 2, 0)
    with pytest.raises(RequestError, match=f"^{FLAT_IDS}$"):
        parse(return_logprob=True, token_ids_logprob=[[7]])
    with pytest.raises(RequestError, match="^token_ids_logprob has 1 lists for a batch of 2$"):
        parse_generate({"input_ids": [[1], [2]], "token_ids_logprob": [[7]]}, None)
    for bad in (0, 7, 7.0, True, "7", [7.5], [7, True], [True], [[7], 8], {"7": 1}):
        with pytest.raises(ContractError, match="token_ids_logprob"):
            parse(return_logprob=True, token_ids_logprob=bad)
    with pytest.raises(ContractError, match="top_logprobs_num"):
        parse(return_logprob=True, top_logprobs_num=2.0)


# --------------------------------------------------------------------------
# The engine against a direct forward pass

BIASED = 1234


@pytest.fixture
async def engine(tiny_model):
    async with running(Engine(parse_args(["--model", str(tiny_model), "--threads", "1"]))) as url:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as http:
            async def generate(body: dict) -> dict:
                async with http.post(url + "/generate", json=body) as resp:
                    assert resp.status == 200, await resp.text()
                    return await resp.json()
            yield generate


@pytest.fixture(scope="module")
def ref(tiny_model):
    model = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32).eval()
    return model, AutoTokenizer.from_pretrained(tiny_model)


def forward(model, ids: list[int]) -> torch.Tensor:
    with torch.inference_mode():
        return model(torch.tensor([ids])).logits[0].float()


def assert_rows(rows: list, ref_rows: torch.Tensor, k: int, ids: list[int], chosen: list) -> None:
    """Engine rows (top-k, chosen ids) equal the reference log-prob rows within 1e-5."""
    assert len(rows) == len(chosen) == len(ref_rows)
    for row, pick, lps in zip(rows, chosen, ref_rows):
        vals, top = lps.topk(k)
        assert [e[1] for e in row] == top.tolist()
        assert max(abs(e[0] - v) for e, v in zip(row, vals.tolist())) <= 1e-5
        assert [e[1] for e in pick] == ids
        assert max(abs(e[0] - lps[t].item()) for e, t in zip(pick, ids)) <= 1e-5


@pytest.mark.parametrize("temperature", [0.0, 0.7], ids=["greedy", "t0.7"])
async def test_rows_equal_a_direct_forward(engine, ref, temperature):
    model, tok = ref
    prompt = tok("The quick brown fox jumps over the lazy dog.")["input_ids"]
    s, k, ids = 3, 5, [BIASED, 0, BIASED, 17]
    sp = {"max_new_tokens": 5, "temperature": temperature, "ignore_eos": True, "sampling_seed": 3,
          "logit_bias": {str(BIASED): 4.0}}
    out = await engine({"input_ids": prompt, "sampling_params": sp, "return_logprob": True,
                        "logprob_start_len": s, "top_logprobs_num": k, "token_ids_logprob": ids,
                        "return_text_in_logprobs": True})
    meta, gen = out["meta_info"], out["output_ids"]
    logits = forward(model, prompt + gen)
    # input rows: T = 1, no bias; entry i >= 1 predicts prompt[s+i] from logits at s+i-1
    inputs = torch.log_softmax(logits[s:len(prompt) - 1], -1)
    assert meta["input_top_logprobs"][0] is None and meta["input_token_ids_logprobs"][0] is None
    assert_rows(meta["input_top_logprobs"][1:], inputs, k, ids, meta["input_token_ids_logprobs"][1:])
    # output rows: log_softmax((z + bias) / T), greedy at T = 1, the tensor output_token_logprobs read
    z = logits[len(prompt) - 1:-1].clone()
    z[:, BIASED] += 4.0
    outputs = torch.log_softmax(z / (temperature or 1.0), -1)
    assert_rows(meta["output_top_logprobs"], outputs, k, ids, meta["output_token_ids_logprobs"])
    assert [e[0] for e in meta["output_token_logprobs"]] == pytest.approx(
        [outputs[i, t].item() for i, t in enumerate(gen)], abs=1e-5)
    if temperature == 0.0:  # greedy: the sampled token heads each top-k row, with the same value
        assert [row[0][:2] for row in meta["output_top_logprobs"]] == [e[:2] for e in meta["output_token_logprobs"]]
    # return_text_in_logprobs: each id decoded alone, input entry 0 included
    texts = [e for row in meta["output_top_logprobs"] + meta["input_token_ids_logprobs"][1:] for e in row]
    assert all(e[2] == tok.decode([e[1]]) for e in texts)
    assert meta["input_token_logprobs"][0] == [None, prompt[s], tok.decode([prompt[s]])]


async def test_prefill_only_reports_the_next_token_row_at_t1_with_bias(engine, ref):
    model, _ = ref
    prompt, ids = [31, 32, 33, 34, 35, 36], [BIASED, 5]
    out = await engine({"input_ids": prompt, "return_logprob": True, "logprob_start_len": 1, "top_logprobs_num": 3,
                        "token_ids_logprob": ids, "sampling_params": {
                            "max_new_tokens": 0, "temperature": 0.5, "logit_bias": {str(BIASED): 4.0}}})
    meta = out["meta_info"]
    assert (out["output_ids"], meta["output_token_logprobs"]) == ([], [])
    logits = forward(model, prompt)
    z = logits[-1].clone()
    z[BIASED] += 4.0
    assert_rows(meta["output_top_logprobs"], torch.log_softmax(z, -1)[None], 3, ids,
                meta["output_token_ids_logprobs"])
    assert_rows(meta["input_top_logprobs"][1:], torch.log_softmax(logits[1:-1], -1), 3, ids,
                meta["input_token_ids_logprobs"][1:])
    assert len(meta["input_top_logprobs"]) == len(prompt) - 1
