"""bench/learning.py's bookkeeping, no run: the order runs start in, and the saved runs `--resume` reuses
only under the settings they ran with."""
from __future__ import annotations

from pathlib import Path

import pytest

from tests.harness import load_bench

learning = load_bench("learning")


@pytest.fixture
def model_dir(tmp_path) -> Path:
    (tmp_path / "config.json").write_text("{}")  # enough of a model directory for the argument checks
    return tmp_path


def test_runs_start_seed_by_seed_so_an_interrupted_bench_has_whole_seeds(model_dir):
    args = learning.parse_args(["--model", str(model_dir), "--arms", "rl,opd,shuffled", "--seeds", "2", "--jobs", "2"])
    assert learning.plan(args) == [("rl", 1), ("opd", 1), ("shuffled", 1), ("rl", 2), ("opd", 2), ("shuffled", 2)]
    with pytest.raises(SystemExit):
        learning.parse_args(["--model", str(model_dir), "--jobs", "0"])


def test_a_saved_run_is_reused_only_under_the_same_settings(model_dir, tmp_path):
    args = learning.parse_args(["--model", str(model_dir), "--lora", "--train", 'aggregation="token_sum"'])
    folder, run = tmp_path / "out.runs", {"points": [{"steps": 0, "satisfied": 0.5}], "exit": 0}
    assert learning.load_run(folder, "rl", 1, learning.settings(args)) is None  # nothing saved yet
    learning.save_run(folder, "rl", 1, learning.settings(args), run)
    assert sorted(p.name for p in folder.iterdir()) == ["rl-1.json"]  # no temporary file left behind
    assert learning.load_run(folder, "rl", 1, learning.settings(args)) == run
    assert learning.load_run(folder, "rl", 2, learning.settings(args)) is None  # another seed
    for changed in (["--lr", "1e-4"], ["--steps", "7"], ["--personas", "concise"], ["--train", "kl_loss_coef=0.1"]):
        other = learning.parse_args(["--model", str(model_dir), "--lora", *changed])
        assert learning.load_run(folder, "rl", 1, learning.settings(other)) is None, changed
