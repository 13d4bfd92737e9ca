"""Degeneration metrics (clawd/safety/degeneration.py): exact values on hand-computed sets, edge cases, and a
collapse that `flags` names against a healthy version 0, with a healthy negative control."""
from __future__ import annotations

import json

import pytest

from clawd.safety.degeneration import (MIN_REPLIES, by_version, distinct_n, flags, opening, reply_of, session_of,
                                       summarise, words)
from clawd.turns import FinishedTurn, Turn

# Version 0 of the demo: whole sentences, different for every question.
HEALTHY = [
    "The largest planet in the solar system is Jupiter.",   # 9 words, 8 bigrams
    "The chemical symbol for gold is Au.",                  # 7 words, 6 bigrams
    "Rome is the capital of Italy.",                        # 6 words, 5 bigrams
    "Water boils at 100 degrees Celsius at sea level.",     # 9 words, 8 bigrams
    "Shakespeare wrote Hamlet around 1600.",                # 5 words, 4 bigrams
    "A triangle has three sides.",                          # 5 words, 4 bigrams
]
# Another healthy set, for the negative control.
HEALTHY_TOO = [
    "Paris is the capital of France.",
    "Light travels faster than sound.",
    "The Pacific is the largest ocean.",
    "Mount Everest is the tallest mountain.",
    "Bees make honey from nectar.",
]
# The demo at v30-v33: one-word replies and one template ("What is the capital of Italy?" -> "The answer is a city.").
COLLAPSED = [
    "You", "I", "A", "You",
    "The answer is a city.", "The answer is a planet.", "The answer is a number.", "The answer is a city.",
    "I", "The answer is a color.",
]


def test_words_casefold_split_punctuation_keep_apostrophes():
    assert words("The cat sat.") == ["the", "cat", "sat"]
    assert words("Don't stop; it\u2019s 3.14!") == ["don't", "stop", "it\u2019s", "3", "14"]
    assert words("Straße, CAFÉ \u2014 naïve") == ["strasse", "café", "naïve"]
    assert words("?!... \u2014 ,") == [] and words("") == [] and words("   \n") == []


def test_distinct_n_by_hand():
    texts = ["The cat sat.", "The cat ran!", "", "Dogs."]
    # unigrams: the cat sat | the cat ran | - | dogs: 7 in all, 5 distinct (the cat sat ran dogs)
    assert distinct_n(texts, 1) == 5 / 7
    # bigrams: (the cat) (cat sat) | (the cat) (cat ran): 4, 3 distinct; none spans two replies
    # (no "sat the"), and "Dogs." has none
    assert distinct_n(texts, 2) == 3 / 4
    # trigrams: (the cat sat) (the cat ran): 2, both distinct
    assert distinct_n(texts, 3) == 1.0


def test_distinct_n_undefined_is_none():
    assert distinct_n([], 1) is None
    assert distinct_n(["", "...", "Yes."], 2) is None  # no reply has two words: no bigram
    assert distinct_n(iter(["a b"]), 2) == 1.0         # any iterable
    with pytest.raises(ValueError):
        distinct_n(["a"], 0)


def test_opening():
    assert opening(["the", "answer", "is", "a", "city"]) == "the answer is"
    assert opening(["the", "answer", "is"], k=2) == "the answer"
    assert opening(["you"]) == "you"
    assert opening([]) is None


def test_summarise_by_hand():
    s = summarise(["The cat sat.", "The cat ran!", "", "Dogs."])
    assert s == {
        "replies": 4,
        "words": 7,                          # 3 + 3 + 0 + 1
        "mean_words": 1.75,                  # 7 / 4
        "mean_chars": 7.25,                  # (12 + 12 + 0 + 5) / 4
        "empty_share": 0.25,                 # "" of 4
        "one_word_share": 0.5,               # "" (0 words) and "Dogs." (1) of 4
        "repeated_opening_share": 0.0,       # "the cat sat", "the cat ran", -, "dogs": none shared
        "distinct_1": 0.7143,                # 5 / 7 = 0.714285...
        "distinct_2": 0.75,                  # 3 / 4
        "top_reply_share": 0.0,              # no whole reply repeats
        "opening_words": 3,
        "top_openings": [],
        "top_replies": [],
    }
    # k = 2: "the cat" opens 2 of the 4 replies
    s2 = summarise(["The cat sat.", "The cat ran!", "", "Dogs."], k=2)
    assert s2["repeated_opening_share"] == 0.5 and s2["top_openings"] == [["the cat", 2]]
    assert s2["opening_words"] == 2


def test_summarise_one_word_replies():
    s = summarise(["You", "you.", "I", "I!", "I", "A"])
    # normalised: you you i i i a
    assert s["top_replies"] == [["i", 3], ["you", 2]]   # "a" is seen once: not listed
    assert s["top_openings"] == [["i", 3], ["you", 2]]
    assert s["top_reply_share"] == 0.5                  # 3 / 6
    assert s["repeated_opening_share"] == 0.8333        # (3 + 2) / 6
    assert s["one_word_share"] == 1.0 and s["empty_share"] == 0.0
    assert s["distinct_1"] == 0.5                       # 3 distinct of 6
    assert s["distinct_2"] is None                      # no bigram
    assert s["mean_words"] == 1.0 and s["mean_chars"] == 2.0  # (3 + 4 + 1 + 2 + 1 + 1) / 6 = 12 / 6


def test_summarise_top_is_capped_and_ties_keep_first_seen():
    s = summarise(["b", "a", "b", "a", "c", "c", "d"], top=2)
    assert s["top_replies"] == [["b", 2], ["a", 2]]     # c also has 2, but top=2
    assert s["top_reply_share"] == 0.2857               # 2 / 7


def test_summarise_counts_what_two_groups_share():
    texts = ["The capital is Rome.", "The capital is Rome!", "The capital is Paris.", "Paris.", "Paris", "Oslo."]
    alone = summarise(texts)  # every reply its own group: any two replies sharing an opening repeat it
    assert alone["repeated_opening_share"] == 0.8333 and alone["top_openings"] == [["the capital is", 3], ["paris", 2]]
    assert alone["top_reply_share"] == 0.3333 and alone["top_replies"] == [["the capital is rome", 2], ["paris", 2]]
    # a session asked again after a correction and got the same opening: consistency, not a template
    grouped = summarise(texts, groups=["a", "a", "b", "c", "c", None])
    assert grouped["repeated_opening_share"] == 0.5        # "the capital is" in a and b: 3 of 6; "paris" in c alone
    assert grouped["top_openings"] == [["the capital is", 3]]
    assert grouped["top_reply_share"] == 0.0 and grouped["top_replies"] == []  # each whole reply within one session
    assert summarise(texts, groups=[None] * 6) == alone    # None: a group of its own
    assert summarise(texts, groups=range(6)) == alone
    assert summarise(texts, groups="abcabc")["repeated_opening_share"] == 0.8333
    with pytest.raises(ValueError, match="5 groups for 6 texts"):
        summarise(texts, groups="abcab")


def test_summarise_edge_cases():
    empty = summarise([])
    assert empty["replies"] == 0 and empty["words"] == 0
    for key in ("mean_words", "mean_chars", "empty_share", "one_word_share", "repeated_opening_share",
                "distinct_1", "distinct_2", "top_reply_share"):
        assert empty[key] is None, key
    assert empty["top_openings"] == [] and empty["top_replies"] == []

    s = summarise(["...", "  ", ""])
    # "..." has characters but no word: not empty, but 0 words; "  " and "" are empty
    assert s["empty_share"] == 0.6667 and s["one_word_share"] == 1.0
    assert s["words"] == 0 and s["mean_chars"] == 1.0   # (3 + 0 + 0) / 3
    assert s["distinct_1"] is None and s["top_replies"] == [] and s["repeated_opening_share"] == 0.0

    u = summarise(["Ça va très bien.", "ÇA VA très bien !", "日本語です。"])
    # ça va très bien (twice, after case folding) | 日本語です (one run, one word)
    assert u["top_replies"] == [["ça va très bien", 2]] and u["words"] == 9
    assert u["one_word_share"] == 0.3333
    assert json.loads(json.dumps(u, ensure_ascii=False)) == u  # JSON-serialisable as is


def test_the_collapse_is_flagged():
    v0, v33 = summarise(HEALTHY), summarise(COLLAPSED)
    # HEALTHY: 35 bigrams, all distinct; six different openings; no one-word reply
    assert v0["distinct_2"] == 1.0 and v0["repeated_opening_share"] == 0.0 and v0["one_word_share"] == 0.0
    # COLLAPSED: bigrams only from the five "the answer is a X": 5 * 4 = 20, distinct: (the answer)
    # (answer is) (is a) + (a city) (a planet) (a number) (a color) = 7 -> 0.35
    assert v33["distinct_2"] == 0.35
    assert v33["one_word_share"] == 0.5                  # You I A You I: 5 of 10
    assert v33["repeated_opening_share"] == 0.9          # you x2, i x2, "the answer is" x5: 9 of 10 ("a" once)
    assert v33["top_openings"][0] == ["the answer is", 5]
    assert v33["top_replies"] == [["you", 2], ["i", 2], ["the answer is a city", 2]]
    assert v33["top_reply_share"] == 0.2                 # 2 of 10: at the threshold, not above it
    found = flags(v33, v0)
    assert [f.split()[0] for f in found] == ["distinct_2", "one_word_share", "repeated_opening_share"]
    assert found[0] == "distinct_2 1.00 -> 0.35: under 50% of the baseline's"
    assert found[1] == "one_word_share 0% -> 50%: above 20%"
    # Without a baseline the absolute thresholds still speak; distinct_2 needs one.
    assert [f.split()[0] for f in flags(v33)] == ["one_word_share", "repeated_opening_share"]


def test_healthy_against_healthy_is_not_flagged():
    v0 = summarise(HEALTHY)
    assert flags(v0, v0) == []
    assert flags(summarise(HEALTHY_TOO), v0) == []
    assert flags(summarise(HEALTHY_TOO)) == []


def test_flags_name_only_what_moved():
    base = {"replies": 10, "distinct_2": 0.8, "one_word_share": 0.5, "repeated_opening_share": 0.1,
            "empty_share": 0.0, "top_reply_share": 0.0}
    now = {**base, "distinct_2": 0.41, "one_word_share": 0.6, "empty_share": 0.2, "top_reply_share": 0.3}
    # distinct_2 0.41 >= 0.4 (half of 0.8); one_word_share was already above 20%: neither moved past a line
    assert [f.split()[0] for f in flags(now, base)] == ["empty_share", "top_reply_share"]
    # Too few replies to flag; a baseline with too few counts as none.
    assert flags({**now, "replies": MIN_REPLIES - 1}, base) == []
    assert [f.split()[0] for f in flags(now, {**base, "replies": 2})] == ["one_word_share", "empty_share",
                                                                         "top_reply_share"]
    assert flags({"replies": 10, "distinct_2": None}, base) == []


def _turn_record(version: int, content: str | None, *, ids: int = 3, finish: str = "stop") -> dict:
    reply = {"role": "assistant", "content": content}
    if content is None:
        reply["tool_calls"] = [{"id": "c", "type": "function", "function": {"name": "f", "arguments": "{}"}}]
    turn = Turn(session_id="s", turn_index=0, principal="p", request_id="r", rid="r", prompt_ids=[1],
                response_ids=list(range(ids)), response_logprobs=[0.0] * ids, temperature=0.7, messages=[],
                tools=None, reply=reply, finish_reason=finish, policy_version=version, weight_version="w",
                created=0.0)
    return FinishedTurn(turn, None, "session_done", 1.0).to_record()


def test_by_version_reads_turn_records_sim_replies_and_pairs():
    records = [
        _turn_record(0, "The cat sat."),
        _turn_record(0, None, finish="tool_calls"),       # a tool call: no text
        _turn_record(1, "You", ids=1, finish="length"),   # the sim's one-token closing reply
        _turn_record(1, "You", ids=1, finish="stop"),     # a policy that says "You" and stops: counted
        {"version": 1, "kind": "answer", "text": "The answer is a city.", "session": 3},
        {"version": 1, "kind": "probe", "text": "The answer is a city.", "session": -1},
        {"version": 1, "kind": "closing", "text": "I"},
        {"version": None, "kind": "answer", "text": "unversioned"},
        (2, "Rome."),
        (2, None),
    ]
    assert reply_of(records[0]) == (0, "The cat sat.") and reply_of(records[2]) == (1, None)
    out = by_version(records)
    assert list(out) == [0, 1, 2]
    assert out[0]["replies"] == 1 and out[0]["skipped"] == 1 and out[0]["words"] == 3
    assert out[1]["replies"] == 3 and out[1]["skipped"] == 2
    assert out[1]["top_replies"] == [["the answer is a city", 2]] and out[1]["one_word_share"] == 0.3333
    assert out[2]["replies"] == 1 and out[2]["skipped"] == 1
    assert json.loads(json.dumps(out)) == {str(v): s for v, s in out.items()}
    assert by_version([]) == {}
    # grouped by session: a sim user's retries in one session share an opening, probes are each their own
    retries = [{"version": 4, "kind": "answer", "text": "The answer is a city.", "session": 3}] * 2
    assert by_version(retries)[4]["repeated_opening_share"] == 0.0
    probe = {**records[5], "version": 4}
    assert by_version(retries + [probe])[4]["repeated_opening_share"] == 1.0
    turns = [_turn_record(5, "It is Rome."), _turn_record(5, "It is Rome.")]
    assert by_version(turns)[5]["repeated_opening_share"] == 0.0  # one session_id
    assert session_of(turns[0]) == "s" and session_of(records[5]) is None and session_of((2, "Rome.")) is None
