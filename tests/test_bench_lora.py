"""LoRA in the benches: bench/lora.py's figures (`bench/swap.py --lora`), its row in bench/all.py, and the
`--lora` flags of bench/learning.py and the demo, which hand `[train] lora_rank` and `lora_lr` to the daemon."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from clawd.tools.sim import demo
from tests.harness import load_bench

lora = load_bench("lora")
swap = load_bench("swap")
learning = load_bench("learning")
bench_all = load_bench("all", "bench_all")


def arms(full_bytes: list[int], lora_bytes: list[int]) -> dict:
    return {"full": {"publish_bytes": full_bytes, "publish_s": [2.0, 4.0, 3.0], "peak_rss_bytes": 3000},
            "lora": {"publish_bytes": lora_bytes, "publish_s": [0.5, 0.25, 1.0], "peak_rss_bytes": 1200}}


ENGINE = {"update_weights_s": [1.0, 3.0], "load_lora_s": [0.2, 0.3, 0.5], "unload_lora_s": [0.01]}


def test_dir_bytes_counts_every_file_below(tmp_path):
    (tmp_path / "sub").mkdir()
    (tmp_path / "adapter_config.json").write_bytes(b"x" * 300)
    (tmp_path / "sub" / "adapter_model.safetensors").write_bytes(b"y" * 4096)
    assert lora.dir_bytes(tmp_path) == 4396


def test_ratios_are_full_over_lora_and_memory_lora_over_full():
    r = lora.ratios(arms([800, 900, 1000], [30, 30, 40]), ENGINE)
    assert r == {"bytes_full_over_lora": 30.0, "publish_s_full_over_lora": 6.0, "swap_s_full_over_lora": 6.666666666666667,
                 "peak_rss_lora_over_full": 0.4}
    assert lora.missed(r, 20.0) == []
    short = lora.ratios(arms([100], [10]), ENGINE)
    assert short["bytes_full_over_lora"] == 10.0
    assert lora.missed(short, 20.0) == ["bytes per publish, full / LoRA 10.0, target >= 20"]
    # Nothing measured: no ratio, and the target counts as missed.
    empty = lora.ratios(arms([], []), {"update_weights_s": [], "load_lora_s": []})
    assert empty["bytes_full_over_lora"] is None and empty["swap_s_full_over_lora"] is None
    assert lora.missed(empty, 20.0) == ["bytes per publish, full / LoRA None, target >= 20"]


def test_all_py_judges_the_lora_bytes_ratio():
    result = {"rank": 16, "targets": {"bytes_full_over_lora": 20.0},
              "ratios": {"bytes_full_over_lora": 27.5, "swap_s_full_over_lora": 8.0, "peak_rss_lora_over_full": 0.45}}
    rows = bench_all.lora(result)
    assert [(r["shown"], r["target"], r["ok"]) for r in rows] == [("27.5x", ">= 20", True), ("8.0x", "", None),
                                                                 ("0.45", "", None)]
    result["ratios"]["bytes_full_over_lora"] = 12.0
    assert bench_all.lora(result)[0]["ok"] is False
    assert "lora" in bench_all.SCRIPTS and bench_all.OUT_FLAG["lora"] == "--out"


def test_swap_py_hands_lora_to_bench_lora(tmp_path, capsys):
    """`bench/swap.py --lora` is bench/lora.py with the other flags; without --lora swap.py's own parser runs."""
    with pytest.raises(SystemExit) as exc:
        swap.main(["--lora", "--model", str(tmp_path / "none")])
    assert exc.value.code == 2 and f"no model at {tmp_path / 'none'}" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        swap.main(["--rank", "4"])  # a flag of bench/lora.py only
    assert "unrecognized arguments: --rank 4" in capsys.readouterr().err


@pytest.fixture
def model_dir(tmp_path) -> Path:
    """Enough of a model directory for the argument checks (they look for config.json)."""
    (tmp_path / "config.json").write_text("{}")
    return tmp_path


def test_learning_lora_passes_the_rank_and_lora_lr_to_train(model_dir):
    args = learning.parse_args(["--model", str(model_dir), "--lora"])
    assert (args.lora_rank, args.lr) == (16, 5e-4)  # the demo's default LoRA rate (its settings runs)
    assert learning.lora_keys(args) == {"lora": {"rank": 16, "lr": 5e-4}}
    assert args.out.endswith("learning-lora.json")
    args = learning.parse_args(["--model", str(model_dir), "--lora-rank", "8", "--lr", "3e-4", "--out", "x.json"])
    assert (args.lora_rank, args.lr, args.out) == (8, 3e-4, "x.json")
    assert learning.lora_keys(args) == {"lora": {"rank": 8, "lr": 3e-4}}
    full = learning.parse_args(["--model", str(model_dir)])
    assert (full.lora_rank, full.lr, learning.lora_keys(full)) == (0, 1e-5, {})
    assert full.out.endswith("learning.json")
    with pytest.raises(SystemExit):
        learning.parse_args(["--model", str(model_dir), "--lora-rank", "0"])


def test_demo_lora_sets_the_train_section_and_names_it(model_dir):
    args = demo.parse_args(["--model", str(model_dir), "--lora"])
    train = demo.clawd_sections(args, model_dir / "state")["train"]
    assert (train["lora"]["rank"], train["lora"]["lr"], args.tuning) == (16, 3e-4, "LoRA rank 16")
    args = demo.parse_args(["--model", str(model_dir), "--lora-rank", "4", "--lr", "2e-4"])
    train = demo.clawd_sections(args, model_dir / "state")["train"]
    assert (train["lora"]["rank"], train["lora"]["lr"], args.tuning) == (4, 2e-4, "LoRA rank 4")
    args = demo.parse_args(["--model", str(model_dir)])  # LoRA is the demo's default (its settings runs)
    assert demo.clawd_sections(args, model_dir / "state")["train"]["lora"]["rank"] == 16
    args = demo.parse_args(["--model", str(model_dir), "--full"])
    train = demo.clawd_sections(args, model_dir / "state")["train"]
    assert "lora" not in train and (train["optimizer"]["lr"], args.tuning) == (1e-5, "full fine-tune")
    for bad in (["--lora-rank", "-1"], ["--full", "--lora"]):
        with pytest.raises(SystemExit):
            demo.parse_args(["--model", str(model_dir), *bad])


def test_the_trainer_worker_publishes_adapters_or_a_model_and_counts_them(tiny_model, tmp_path):
    """Each arm's worker (in this process here; the bench gives each a fresh one for its peak RSS)."""
    threads = torch.get_num_threads()
    try:
        for arm in ("lora", "full"):
            lora.worker(tiny_model, tmp_path / arm, arm, 4, 1, tmp_path / f"{arm}.json")
    finally:
        torch.set_num_threads(threads)  # the worker pins one thread, as the bench's children run
    got = {arm: json.loads((tmp_path / f"{arm}.json").read_text()) for arm in ("lora", "full")}
    adapter, model = got["lora"]["steps"][0], got["full"]["steps"][0]
    assert adapter["files"] == ["adapter_config.json", "adapter_model.safetensors"] and "config.json" in model["files"]
    assert adapter["bytes"] == lora.dir_bytes(Path(adapter["dir"])) < model["bytes"] == lora.dir_bytes(Path(model["dir"]))
    assert (got["lora"]["lora_rank"], got["lora"]["learning_rate"], got["full"]["lora_rank"]) == (4, 1e-4, 0)
    assert got["lora"]["trainable_params"] < got["full"]["trainable_params"] == got["full"]["params"]
    # AdamW keeps two moments per trainable float32 parameter (and a step count per tensor).
    assert got["lora"]["optimizer_bytes"] >= 8 * got["lora"]["trainable_params"]
    assert got["lora"]["optimizer_bytes"] < got["full"]["optimizer_bytes"]
