"""Privacy, piece by piece: consent and PII at the edge to scoring, the records they leave, what an external
judge is shown, private file modes, the retention sweep, and records read and rewritten per principal."""
from __future__ import annotations

import asyncio
import json
import os
import stat
from dataclasses import replace

from clawd.config.auth import ApiKey
from clawd.privacy import files
from clawd.privacy.policy import CONSENT, PII, Privacy
from clawd.privacy.retention import Retention
from clawd.config.privacy import PrivacyConfig
from clawd.records import RecordWriter
from clawd.turns import NO_TRAIN, FinishedTurn, Turn

DAY = 86400.0
T0 = 1_790_000_000.0  # 2026-09-21 UTC
EMAIL = "jane.doe@example.org"


def _turn(content="What is 2+2?", reply="4.", **kw) -> Turn:
    base = dict(session_id="s", turn_index=0, principal="alice", request_id="chatcmpl-1", rid="r1",
                prompt_ids=[1, 2, 3], response_ids=[4, 5], response_logprobs=[-0.5, -0.25], temperature=1.0,
                messages=[{"role": "user", "content": content}], tools=None,
                reply={"role": "assistant", "content": reply}, finish_reason="stop", policy_version=0,
                weight_version="0", created=T0)
    return Turn(**{**base, **kw})


def _finished(turn: Turn, next_text: str = "Thanks!") -> FinishedTurn:
    return FinishedTurn(turn, [{"role": "user", "content": next_text}], None, T0 + 1)


KEYS = (ApiKey("alice", "k" * 8), ApiKey("bot", "b" * 8, train=False), ApiKey("ghost", "g" * 8, record=False))


def test_a_turn_without_pii_passes_unchanged_and_is_recorded_whole():
    privacy = Privacy(PrivacyConfig(), KEYS)
    finished = _finished(_turn())
    admitted, record = privacy.admit(finished)
    assert admitted is finished and record == finished.to_record()
    assert (privacy.stats.scanned, privacy.stats.with_pii, privacy.stats.excluded) == (1, 0, {})


def test_pii_in_the_prompt_excludes_the_turn_and_its_record_is_redacted_without_token_ids():
    privacy = Privacy(PrivacyConfig(), KEYS)
    admitted, record = privacy.admit(_finished(_turn(f"Mail me at {EMAIL} please"), "Or call +44 20 7946 0958"))
    assert admitted.turn.excluded == PII and not admitted.trainable
    assert record["messages"] == [{"role": "user", "content": "Mail me at [EMAIL] please"}]
    assert record["next_state"] == [{"role": "user", "content": "Or call [PHONE]"}]
    assert record["reply"] == {"role": "assistant", "content": "4."}
    assert record["pii"] == {"email": 1, "phone": 1} and record["excluded"] == PII
    assert (record["prompt_ids"], record["response_ids"], record["response_logprobs"]) == (3, 2, 2)
    assert EMAIL not in json.dumps(record)
    assert privacy.stats.found == {"email": 1, "phone": 1} and privacy.stats.excluded == {PII: 1}


def test_pii_in_a_tool_definition_or_a_name_field_excludes_the_turn_and_is_redacted_in_the_record():
    privacy = Privacy(PrivacyConfig(), KEYS)
    tools = [{"type": "function", "function": {"name": "notify", "description": f"Mails {EMAIL} the result",
                                               "parameters": {"type": "object", "properties": {
                                                   "to": {"type": "string", "enum": ["+44 20 7946 0958"]}}}}}]
    admitted, record = privacy.admit(_finished(_turn(tools=tools)))
    assert admitted.turn.excluded == PII and record["pii"] == {"email": 1, "phone": 1}
    assert record["tools"][0]["function"]["description"] == "Mails [EMAIL] the result"
    assert record["tools"][0]["function"]["parameters"]["properties"]["to"]["enum"] == ["[PHONE]"]
    assert tools[0]["function"]["description"] == f"Mails {EMAIL} the result"  # the turn's own is untouched
    named = [{"role": "user", "name": EMAIL, "content": "What is 2+2?"}]
    admitted, record = privacy.admit(_finished(_turn(messages=named)))
    assert admitted.turn.excluded == PII and record["messages"][0]["name"] == "[EMAIL]"


def test_pii_only_in_the_next_state_is_trained_but_redacted_in_the_record():
    # The next message is not trained in this turn (it is the next turn's prompt, excluded there).
    privacy = Privacy(PrivacyConfig(), KEYS)
    admitted, record = privacy.admit(_finished(_turn(), f"it is {EMAIL}"))
    assert admitted.turn.excluded is None and admitted.trainable
    assert record["next_state"] == [{"role": "user", "content": "it is [EMAIL]"}] and record["prompt_ids"] == 3


def test_keep_trains_a_turn_with_pii_and_records_can_be_kept_as_served():
    privacy = Privacy(PrivacyConfig(pii_training="keep", redact_records=False), KEYS)
    finished = _finished(_turn(f"Mail me at {EMAIL}"))
    admitted, record = privacy.admit(finished)
    assert admitted is finished and record == finished.to_record()
    assert privacy.stats.with_pii == 1 and privacy.stats.redacted_records == 0


def test_consent_a_key_with_train_false_is_never_trained_and_recorded_without_its_words():
    privacy = Privacy(PrivacyConfig(), KEYS)
    admitted, record = privacy.admit(_finished(_turn("my diary", principal="bot")))
    assert admitted.turn.excluded == CONSENT
    assert record["messages"] == [{"role": "user", "chars": 8}] and record["reply"] == {"role": "assistant", "chars": 2}
    assert record["next_state"] == [{"role": "user", "chars": 7}] and record["content"] == "withheld"
    assert (record["prompt_ids"], record["response_ids"]) == (3, 2) and "my diary" not in json.dumps(record)
    assert (record["principal"], record["policy_version"], record["created"]) == ("bot", 0, T0)
    # untrained_content keeps the words; the turn is still never trained
    admitted, record = Privacy(PrivacyConfig(untrained_content=True), KEYS).admit(
        _finished(_turn("my diary", principal="bot")))
    assert admitted.turn.excluded == CONSENT and record["messages"][0]["content"] == "my diary"


def test_no_train_turns_are_recorded_without_their_words_and_a_record_false_key_leaves_none():
    privacy = Privacy(PrivacyConfig(), KEYS)
    admitted, record = privacy.admit(_finished(_turn("secret plans", excluded=NO_TRAIN)))
    assert admitted.turn.excluded == NO_TRAIN and record["content"] == "withheld"
    assert "secret plans" not in json.dumps(record)
    admitted, record = privacy.admit(_finished(_turn(principal="ghost")))
    assert record is None and admitted.trainable and privacy.stats.unrecorded == 1
    assert privacy.judge_record({"principal": "ghost", "raw": ["fine"]}) is None  # no judge record either


def test_keys_reloaded_change_consent_at_the_next_turn():
    privacy = Privacy(PrivacyConfig(), KEYS)
    privacy.set_keys([ApiKey("alice", "k" * 8, train=False)])
    assert privacy.admit(_finished(_turn()))[0].turn.excluded == CONSENT


def test_an_external_judge_sees_pii_replaced_and_judge_records_are_redacted():
    privacy = Privacy(PrivacyConfig(), KEYS)
    turn = _turn(f"Write to {EMAIL}")
    seen, next_state = privacy.for_judge(turn, [{"role": "user", "content": "card 4111 1111 1111 1111 ok"}])
    assert seen.messages == [{"role": "user", "content": "Write to [EMAIL]"}] and seen.principal == "alice"
    assert next_state == [{"role": "user", "content": "card [CARD] ok"}]
    assert turn.messages[0]["content"] == f"Write to {EMAIL}"  # the turn itself is not touched
    clean = _turn()
    assert privacy.for_judge(clean, [])[0] is clean
    record = privacy.judge_record({"raw": [f"The user {EMAIL} is happy \\boxed{{1}}", None], "hint": None})
    assert record["raw"] == ["The user [EMAIL] is happy \\boxed{1}", None]
    off = Privacy(PrivacyConfig(redact_judge=False), KEYS)
    assert off.for_judge(turn, [])[0] is turn


def test_detection_off_finds_nothing_and_keeps_everything():
    privacy = Privacy(PrivacyConfig(pii_categories=()), KEYS)
    finished = _finished(_turn(f"Mail {EMAIL}"))
    assert privacy.admit(finished) == (finished, finished.to_record()) and privacy.stats.scanned == 0


def _mode(path) -> int:
    return stat.S_IMODE(os.lstat(path).st_mode)


def test_tighten_closes_what_an_earlier_run_left_open_and_leaves_links_alone(tmp_path):
    root = tmp_path / "state"
    (root / "records").mkdir(parents=True)
    (root / "records" / "turns.jsonl").write_text("{}")
    os.chmod(root / "records" / "turns.jsonl", 0o666)
    os.chmod(root / "records", 0o777)
    os.chmod(root, 0o755)
    outside = tmp_path / "outside.txt"
    outside.write_text("x")
    os.chmod(outside, 0o644)
    (root / "link").symlink_to(outside)
    assert files.tighten(root, files.Modes(None)) == 3
    assert (_mode(root), _mode(root / "records"), _mode(root / "records" / "turns.jsonl")) == (0o700, 0o700, 0o600)
    assert _mode(outside) == 0o644  # the link's target is not ours
    assert files.tighten(root, files.Modes(None)) == 0
    shared = files.Modes(os.getgid())
    os.chmod(root / "records" / "turns.jsonl", 0o664)
    assert files.tighten(root, shared) == 1 and _mode(root / "records" / "turns.jsonl") == 0o640
    assert (shared.umask, shared.directory, files.Modes(None).umask) == (0o027, 0o750, 0o077)


def test_the_weights_group_reads_published_versions_and_nothing_else(tmp_path):
    import grp
    group = grp.getgrgid(os.getgid()).gr_name
    root = tmp_path / "state"
    (root / "weights" / "v000001").mkdir(parents=True)
    (root / "weights" / "v000001" / "model.safetensors").write_bytes(b"w")
    (root / "records").mkdir()
    files.tighten(root, files.Modes(None))
    share = files.secure_state(root, "", group)
    assert _mode(root) == 0o711 and _mode(root / "records") == 0o700  # searchable, not listable
    assert _mode(root / "weights") == 0o2750 and _mode(root / "weights" / "v000001" / "model.safetensors") == 0o640
    (root / "weights" / "v000002").mkdir(mode=0o700)
    (root / "weights" / "v000002" / "adapter.safetensors").write_bytes(b"a")
    os.chmod(root / "weights" / "v000002" / "adapter.safetensors", 0o600)
    share(str(root / "weights" / "v000002"))
    assert _mode(root / "weights" / "v000002" / "adapter.safetensors") == 0o640
    assert files.secure_state(tmp_path / "other", "", "") is None


def _version(state, n, checkpoint_step=None):
    (state / "weights" / f"v{n:06d}").mkdir(parents=True)
    if checkpoint_step is not None:
        ckpt = state / "checkpoints" / f"ckpt-{checkpoint_step:08d}"
        ckpt.mkdir(parents=True)
        (ckpt / "state.json").write_text(json.dumps({"version": n, "step": checkpoint_step}))
        (ckpt / "complete").write_text("")


def test_the_retention_sweep_removes_what_is_past_use_and_never_a_rollback_target(tmp_path):
    state = tmp_path / "state"
    turns, judge = RecordWriter(state / "records", retention_days=2), RecordWriter(state / "records", kind="judge",
                                                                                 retention_days=2)
    for day in range(4):
        turns.write({"day": day}, now=T0 + day * DAY)
    turns.close()
    (state / "records" / "judge-2026-09-20.jsonl").write_text("{}\n")
    (state / "rejected").mkdir()
    old = state / "rejected" / "v000002.samples.jsonl"
    old.write_text("{}\n")
    os.utime(old, (T0, T0))
    (state / "rejected" / "v000003.samples.jsonl").write_text("{}\n")
    for n, ckpt in ((1, 1), (2, None), (3, None), (4, 2), (5, None), (6, None), (7, None)):
        _version(state, n, ckpt)
    (state / "exports" / "alice-stale").mkdir(parents=True)
    os.utime(state / "exports" / "alice-stale", (T0, T0))
    compacted = []
    retention = Retention(state, (turns, judge), 2, compact_journal=lambda: compacted.append(1) or ["seg"],
                          serving=lambda: 6, keep_versions=2, pinned=lambda: {3})
    removed = retention.sweep(now=T0 + 3 * DAY + 1)
    # the judge's file of 2026-09-20, never written to again (the turns' writer pruned its own old day as it
    # rotated); v2 and v5 are past use: v1, v4 have checkpoints, v3 is pinned, v6 serves, v6-v7 are the newest
    assert removed == {"records": 1, "rejected": 1, "segments": 1, "weights": 2, "exports": 1}
    assert sorted(p.name for p in (state / "weights").iterdir()) == ["v000001", "v000003", "v000004", "v000006",
                                                                       "v000007"]
    assert sorted(p.name for p in (state / "records").iterdir()) == ["turns-2026-09-22.jsonl", "turns-2026-09-23.jsonl",
                                                                       "turns-2026-09-24.jsonl"]
    assert not old.exists() and (state / "rejected" / "v000003.samples.jsonl").exists()
    assert retention.sweep(now=T0 + 3 * DAY + 2) == {"records": 0, "rejected": 0, "segments": 1, "weights": 0,
                                                     "exports": 0}
    assert retention.stats.sweeps == 2 and retention.stats.removed["weights"] == 2


def test_a_failing_part_of_the_sweep_is_counted_and_the_rest_runs(tmp_path):
    def broken():
        raise OSError(5, "Input/output error")
    retention = Retention(tmp_path, (), 1, compact_journal=broken, serving=lambda: 0, keep_versions=1)
    assert retention.sweep() == {"records": 0, "rejected": 0, "weights": 0, "exports": 0}
    assert retention.stats.failures == 1


def test_records_are_selected_and_removed_per_principal_torn_lines_included(tmp_path):
    w = RecordWriter(tmp_path)
    w.write({"principal": "alice", "n": 1}, now=T0)
    w.write({"principal": "bob", "n": 2}, now=T0)
    w.write({"principal": "alice", "n": 3}, now=T0 + DAY)
    with open(w.path_for("2026-09-22"), "a") as f:
        f.write('{"principal":"alice","messages":[{"content":"cut he\n')  # a torn line of theirs
    assert [json.loads(line)["n"] for line in list(w.select("alice"))[:2]] == [1, 3]
    assert len(list(w.select("alice"))) == 3
    assert asyncio.run(w.remove("alice")) == 3
    assert [json.loads(line) for line in w.select("bob")] == [{"principal": "bob", "n": 2}]
    assert list(w.select("alice")) == [] and "cut he" not in (tmp_path / "turns-2026-09-22.jsonl").read_text()
    w.write({"principal": "alice", "n": 4}, now=T0 + DAY)  # the writer reopens after the rewrite
    assert len(list(w.select("alice"))) == 1
    assert _mode(w.path_for("2026-09-22")) == 0o600
    w.close()


def test_a_rewrite_gives_the_loop_back_and_keeps_the_lines_written_meanwhile(tmp_path):
    """A forget over many records used to read and rewrite them with no yield (seconds per GB)."""
    w = RecordWriter(tmp_path)
    for n in range(5000):
        w.write({"principal": "alice" if n % 2 else "bob", "n": n}, now=T0)

    async def main():
        ticks = 0

        async def serve():  # a chat turn finishing while the forget runs
            nonlocal ticks
            while True:
                ticks += 1
                w.write({"principal": "bob" if ticks % 2 else "alice", "n": 10_000 + ticks}, now=T0)
                await asyncio.sleep(0)

        other = asyncio.create_task(serve())
        await asyncio.sleep(0)
        removed = await w.remove("alice")
        other.cancel()
        return removed, ticks

    removed, ticks = asyncio.run(main())
    assert removed == 2500 and ticks >= 2
    lines = [json.loads(line) for line in w.path_for("2026-09-21").read_text().splitlines()]
    # bob's lines from before, then bob's written during the rewrite, in order; none of alice's.
    assert [r["n"] for r in lines[:2500]] == list(range(0, 5000, 2))
    assert all(r["principal"] == "bob" for r in lines) and len(lines) > 2500
    assert [r["n"] for r in lines[2500:]] == sorted(r["n"] for r in lines[2500:])
    w.close()


def test_untrained_records_keep_their_sizes_for_every_shape_of_message():
    privacy = Privacy(PrivacyConfig(), KEYS)
    turn = _turn(principal="bot", messages=[{"role": "user", "content": [{"type": "text", "text": "hi"}]},
                                            {"role": "assistant", "content": None, "tool_calls": []}])
    _, record = privacy.admit(replace(_finished(turn), next_state=None, reason="idle_timeout"))
    assert record["next_state"] is None and record["messages"][1] == {"role": "assistant", "chars": 0}
