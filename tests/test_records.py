"""Turn records: daily files, retention, nothing secret."""
import json

from clawd.records import RecordWriter
from clawd.turns import FinishedTurn, Turn

DAY = 86400.0
T0 = 1_790_000_000.0  # 2026-09-21 UTC


def _turn(**kw):
    base = dict(session_id="s", turn_index=0, principal="alice", request_id="chatcmpl-1", rid="r1",
                prompt_ids=[1, 2], response_ids=[3, 4], response_logprobs=[-0.5, -0.25], temperature=1.0,
                messages=[{"role": "user", "content": "hi"}], tools=None,
                reply={"role": "assistant", "content": "yo"}, finish_reason="stop", policy_version=0,
                weight_version="0", created=T0)
    return Turn(**{**base, **kw})


def test_one_line_per_finished_turn_with_next_state_or_reason(tmp_path):
    w = RecordWriter(tmp_path)
    w.write_turn(FinishedTurn(_turn(), [{"role": "user", "content": "thanks"}], None, T0))
    w.write_turn(FinishedTurn(_turn(turn_index=1, excluded="sampling_params"), None, "idle_timeout", T0 + 1))
    w.close()
    (path,) = tmp_path.glob("*.jsonl")
    assert path.name == "turns-2026-09-21.jsonl"
    first, second = [json.loads(line) for line in path.read_text().splitlines()]
    assert first["next_state"] == [{"role": "user", "content": "thanks"}] and first["reason"] is None
    assert first["response_ids"] == [3, 4] and first["response_logprobs"] == [-0.5, -0.25]
    assert (second["next_state"], second["reason"], second["excluded"]) == (None, "idle_timeout", "sampling_params")


def test_rotates_daily_and_deletes_files_past_retention(tmp_path):
    w = RecordWriter(tmp_path, retention_days=2)
    for day in range(5):
        w.write({"day": day}, now=T0 + day * DAY)
    w.close()
    names = sorted(p.name for p in tmp_path.glob("*.jsonl"))
    assert names == ["turns-2026-09-23.jsonl", "turns-2026-09-24.jsonl", "turns-2026-09-25.jsonl"]
    assert json.loads((tmp_path / "turns-2026-09-25.jsonl").read_text()) == {"day": 4}


def test_appends_across_restarts(tmp_path):
    for i in range(2):
        w = RecordWriter(tmp_path)
        w.write({"i": i}, now=T0)
        w.close()
    assert (tmp_path / "turns-2026-09-21.jsonl").read_text().count("\n") == 2
