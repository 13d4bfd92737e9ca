"""Behaviour monitors per policy version: is the version now serving behaving like the ones before it?

Live learning can go wrong slowly and quietly: the judge rewards a form, the policy collapses into it,
and every reply still looks like a reply. These monitors watch each version's live traffic (its
replies, the judge's verdicts on them, the trainer's steps) and compare it with a baseline pooled from
the last versions that served cleanly. A monitor that drifts past its threshold raises an `Alarm`
whose action the daemon carries out: "alarm" (say it: log, status, dashboard), "halt" (pause learning,
keep serving), "rollback" (serve the last clean version again). Thresholds and actions come from
[monitors] (clawd.config.monitors: MonitorRule, DEFAULT_RULES); this module only measures and compares.

The monitors, what each catches, and why its default rule:
- mean_words (relative, either way; alarm at ±50%): replies got much longer (rambling, loops up to the
  length cap) or much shorter. Learning to be brief is legitimate, so this only says it.
- empty_share (rise; rollback at +10 points): empty replies answer nothing; a healthy policy rarely
  gives one, so a tenth more of them is a broken policy, not a style.
- one_word_share (rise; rollback at +20 points): "You", "I", "A": a few one-word answers ("Rome.")
  are fine, a fifth more of them is a habit, the collapse form-only rewards breed.
- repeated_opening_share (rise; rollback at +30 points): different questions, one template ("The
  answer is ..."); some shared openings are normal, so the margin is wide. Only openings shared across
  sessions count: a retry in one session (the question asked again after a correction) gets the same
  opening, and a version that served a burst of retries read as drifting.
- top_reply_share (rise; rollback at +20 points): one whole reply given to a fifth more of all
  questions is no longer answering them.
- distinct_2 (fall under 50% of the baseline's; rollback): replies now share phrases wholesale, not
  just function words. Distinct-n falls as a set grows, hence both sides keep a bounded window.
- refusal_share (rise; halt at +10 points, `is_refusal`): the policy learnt that refusing scores; stop
  learning and let a person look, as refusals are sometimes right.
- tool_error_share (rise; halt at +10 points, `tool_call_error`): tool calls stopped parsing or name
  tools that were not offered; agents depending on it break, but the cause may be the clients.
- reward_mean (fall by more than 0.5; alarm): the judge's reward is in [-1, 1]; a fall of a quarter of
  its range says the replies got worse by the judge's own measure, or the judge changed: say it.
- hint_share (rise; alarm at +30 points): the judge hints (a correction for distillation) far more
  often: replies got worse, or the judge stricter.
- kl (rise by more than 1 nat; halt): the trainer's sampled KL to its frozen reference (step metric
  "loss_kl", reported only when [train.loss] kl_coef > 0): the policy ran far from where it started.
- entropy (fall under 50% of the baseline's; alarm): the policy's per-token entropy on its own samples
  (step metric "entropy"): it is becoming deterministic, the usual prelude to a collapse.

Where the numbers come from: the text monitors are `clawd.safety.degeneration.summarise` over the last
`TEXTS_KEPT` replies of a version (the same definitions the demo and the benches print), each kept to its
first `TEXT_CHARS` characters, so a tally holds at most TEXTS_KEPT x TEXT_CHARS characters whatever the
traffic; mean_words alone counts each kept reply's words in full when it arrives, as the cut would cap
it. Refusals, tool errors, judgements and steps are counts over everything observed. Pure: no I/O, no clock, standard
library and floor modules only; the daemon feeds it and acts on what `check` returns.
"""
from __future__ import annotations

import itertools
import json
from collections import OrderedDict, deque
from collections.abc import Iterable, Mapping
from dataclasses import asdict, dataclass
from typing import Any

from clawd.checks import is_finite
from clawd.safety import degeneration
from clawd.config.monitors import DEFAULT_RULES, MonitorRule, MonitorsConfig

TEXTS_KEPT = 512       # reply texts a tally keeps per version: enough for stable shares, bounded memory
TEXT_CHARS = 1000      # of each kept text (stripped): ~170 words hold its opening, its phrases, its template
VERSIONS_KEPT = 64     # versions `Monitors` keeps tallies for, least recently observed dropped first
REFUSAL_WITHIN = 6     # a refusal phrase counts only when it starts among a reply's first 6 words
KL_KEY, ENTROPY_KEY = "loss_kl", "entropy"  # the trainer's step metrics (clawd.trainer.worker.step._epoch)
ACTION_RANK = {"alarm": 1, "halt": 2, "rollback": 3}
_UIDS = itertools.count()  # tells a tally from a later one of the same version (a cache key, not a clock)


@dataclass(frozen=True)
class Monitor:
    """How one monitor measures drift. kind: "rise" (now − base > threshold, absolute), "fall"
    (base − now > threshold, absolute), "moves" (|now − base| > threshold × base), "keeps" (now <
    (1 − threshold) × base). count: the summary count that must reach the minimum on both sides."""
    name: str
    kind: str
    count: str
    unit: str  # how the detail line prints values: "share", "number", "nats"


MONITORS: dict[str, Monitor] = {m.name: m for m in (
    Monitor("mean_words", "moves", "replies", "number"),
    Monitor("empty_share", "rise", "replies", "share"),
    Monitor("one_word_share", "rise", "replies", "share"),
    Monitor("repeated_opening_share", "rise", "replies", "share"),
    Monitor("top_reply_share", "rise", "replies", "share"),
    Monitor("distinct_2", "keeps", "replies", "number"),
    Monitor("refusal_share", "rise", "replies", "share"),
    Monitor("tool_error_share", "rise", "tool_turns", "share"),
    Monitor("reward_mean", "fall", "judgements", "number"),
    Monitor("hint_share", "rise", "judgements", "share"),
    Monitor("kl", "rise", "kl_steps", "nats"),
    Monitor("entropy", "keeps", "entropy_steps", "number"),
)}


# --- refusals ------------------------------------------------------------------------------------

# English only, deliberately specific: "I can't help with", not "I can't" ("I can't be sure, but it is
# Paris" answers). Matched on `degeneration.words`, so case and punctuation do not matter.
REFUSAL_PHRASES = (
    "I can't help with", "I cannot help with", "I can't assist", "I cannot assist",
    "I can't provide", "I cannot provide", "I can't comply", "I cannot comply",
    "I'm unable to help", "I'm unable to assist", "I am unable to help", "I am unable to assist",
    "I'm not able to help", "I won't be able to help", "I must decline",
    "I'm sorry, but I", "I am sorry, but I", "Sorry, but I can't", "Sorry, I can't",
    "I apologize, but I", "As an AI language model", "As an AI, I",
)


def _refusal_words(text: str) -> list[str]:
    return degeneration.words(text.replace("\u2019", "'"))  # "I’m" is "I'm"


_PHRASES = tuple(tuple(_refusal_words(p)) for p in REFUSAL_PHRASES)
_LONGEST = max(map(len, _PHRASES))
# The phrases by their first word: a reply's word starts few of them.
_BY_FIRST = {first: tuple(p for p in _PHRASES if p[0] == first) for first in {p[0] for p in _PHRASES}}


def is_refusal(text: str) -> bool:
    """True when one of REFUSAL_PHRASES starts among the reply's first REFUSAL_WITHIN words
    (case-insensitive, punctuation ignored, ’ read as '). Anchored at the start because a refusal leads
    with it ("Sorry, I can't help with that", "Thanks for asking, but I cannot assist"), while an answer
    that apologises later ("Paris is the capital of France. I'm sorry, but I ...") still answered."""
    head = _refusal_words(text.lstrip()[:TEXT_CHARS])[:REFUSAL_WITHIN - 1 + _LONGEST]
    return any(tuple(head[i:i + len(p)]) == p for i in range(min(REFUSAL_WITHIN, len(head)))
               for p in _BY_FIRST.get(head[i], ()))


# --- tool-call errors ----------------------------------------------------------------------------

def _offered_names(tools: Iterable[Any]) -> set[str]:
    names = set()
    for tool in tools:
        fn = tool.get("function") if isinstance(tool, Mapping) else None
        if isinstance(fn, Mapping) and isinstance(fn.get("name"), str):
            names.add(fn["name"])
    return names


def _arguments_object(arguments: Any) -> bool:
    if not isinstance(arguments, str):
        return False
    try:
        return isinstance(json.loads(arguments), dict)
    except json.JSONDecodeError:
        return False


def tool_call_error(record: Mapping[str, Any]) -> bool | None:
    """Whether one turn record (`FinishedTurn.to_record()`) got tool calling wrong; None when it was
    offered no tools. True when the reply's content still holds a "<tool_call>" tag (the serving parser
    leaves a malformed or unclosed block as text: clawd.serving.parsers.OutputParser), or a call names
    a tool not offered, or its `function.arguments` is not a JSON object. Else False (no call is no
    error: answering in text is allowed)."""
    tools = record.get("tools")
    if not tools:
        return None
    reply = record.get("reply") or {}
    content = reply.get("content")
    if isinstance(content, str) and "<tool_call>" in content:
        return True
    offered = _offered_names(tools)
    for call in reply.get("tool_calls") or ():
        fn = call.get("function") if isinstance(call, Mapping) else None
        if not isinstance(fn, Mapping) or fn.get("name") not in offered or not _arguments_object(fn.get("arguments")):
            return True
    return False


# --- the tally of one version --------------------------------------------------------------------


def _share(x: int, n: int) -> float | None:
    return round(x / n, degeneration.RATIO_DIGITS) if n else None


def _mean(total: float, n: int) -> float | None:
    return round(total / n, degeneration.RATIO_DIGITS) if n else None


class Tally:
    """What one version did: its last `cap` reply texts, and counts of everything else. Bounded: the
    texts are a ring, the rest are integers and sums. The texts' summary is cached until the next reply
    (`degeneration.summarise` over 512 texts costs tens of milliseconds)."""

    def __init__(self, cap: int = TEXTS_KEPT):
        if cap < 1:
            raise ValueError(f"cap must be at least 1, not {cap}")
        self.uid = next(_UIDS)
        self.text_revision = 0  # replies appended: with uid, says whether a cached text summary is current
        self._text: dict[str, Any] | None = None
        self.texts: deque[str] = deque(maxlen=cap)
        self.word_counts: deque[int] = deque(maxlen=cap)  # each kept text's words, counted before the cut
        self.owners: deque[str] = deque(maxlen=cap)  # each kept text's principal: `forget` takes theirs out
        self.sessions: deque[str | None] = deque(maxlen=cap)  # each kept text's session: retries are not a template
        self.turns = 0          # every turn observed
        self.skipped = 0        # turns that were not text replies nor tool turns (cut after <= 1 token)
        self.replies = 0        # text replies, all of them (texts keeps only the last cap)
        self.refusals = 0
        self.tool_turns = 0     # turns offered tools
        self.tool_errors = 0
        self.judgements = 0
        self.hints = 0
        self.reward_sum = 0.0
        self.steps = 0
        self.kl_steps, self.kl_sum = 0, 0.0
        self.entropy_steps, self.entropy_sum = 0, 0.0

    def add_turn(self, text: str | None, *, finish_reason: str | None, response_tokens: int,
                 tools_offered: bool, tool_error: bool | None, owner: str | None = "",
                 session: str | None = None) -> None:
        """One served turn. text None: not a text reply (a tool call without content). A turn cut by
        the length limit after <= 1 token is no reply at all (`degeneration.reply_of`'s rule: a
        one-token closing request's "You" is a first token, not an answer): counted as skipped only.
        owner: the principal whose turn it is; None for one whose turns are not recorded (`record = false`):
        counted, its text never kept. session: its conversation (an opening repeated within one is a
        retry's, not a template: `degeneration.summarise`'s groups); None, a conversation of its own."""
        self.turns += 1
        if finish_reason == "length" and response_tokens <= 1:
            self.skipped += 1
            return
        if tools_offered:
            self.tool_turns += 1
            self.tool_errors += bool(tool_error)
        if not isinstance(text, str):
            self.skipped += not tools_offered
            return
        self.replies += 1
        self.refusals += is_refusal(text)
        if owner is None:
            return
        self.texts.append(text.strip()[:TEXT_CHARS])
        self.word_counts.append(len(degeneration.words(text)))
        self.owners.append(owner)
        self.sessions.append(session)
        self.text_revision += 1
        self._text = None

    def forget(self, principal: str) -> int:
        """Takes `principal`'s kept texts out (their counts stay: numbers, no words); how many went."""
        rings = (self.texts, self.word_counts, self.owners, self.sessions)
        kept = [row for row in zip(*rings) if row[2] != principal]
        gone = len(self.texts) - len(kept)
        if gone:
            for i, ring in enumerate(rings):
                ring.clear()
                ring.extend(row[i] for row in kept)
            self.text_revision += 1
            self._text = None
        return gone

    def add_judgement(self, reward: float, has_hint: bool) -> None:
        """One judge verdict. A reward that is not a finite number is not a verdict: left out."""
        if not is_finite(reward):
            return
        self.judgements += 1
        self.hints += bool(has_hint)
        self.reward_sum += reward

    def add_step(self, metrics: Mapping[str, Any]) -> None:
        """One trainer step's metrics (clawd.trainer.worker.step): "loss_kl" (the sampled KL to the reference,
        present when kl_coef > 0) and "entropy" (per token), each when a finite number."""
        self.steps += 1
        kl, ent = metrics.get(KL_KEY), metrics.get(ENTROPY_KEY)
        if is_finite(kl):
            self.kl_steps, self.kl_sum = self.kl_steps + 1, self.kl_sum + kl
        if is_finite(ent):
            self.entropy_steps, self.entropy_sum = self.entropy_steps + 1, self.entropy_sum + ent

    @classmethod
    def pooled(cls, tallies: Iterable[Tally]) -> Tally:
        """One tally of several versions' raw texts and counts together (a baseline), not an average of
        their summaries: a version with few replies weighs little. Keeps every text of every tally."""
        tallies = list(tallies)
        out = cls(max(1, sum(t.texts.maxlen for t in tallies)))
        for t in tallies:
            out.texts.extend(t.texts)
            out.word_counts.extend(t.word_counts)
            out.owners.extend(t.owners)
            out.sessions.extend(t.sessions)
            for name in ("turns", "skipped", "replies", "refusals", "tool_turns", "tool_errors", "judgements",
                         "hints", "reward_sum", "steps", "kl_steps", "kl_sum", "entropy_steps", "entropy_sum"):
                setattr(out, name, getattr(out, name) + getattr(t, name))
        return out

    def text_summary(self) -> dict[str, Any]:
        """`degeneration.summarise` of the kept texts, cached until the next reply."""
        if self._text is None:
            self._text = degeneration.summarise(self.texts, groups=self.sessions)
        return self._text

    def summary(self) -> dict[str, Any]:
        """JSON-serialisable: every monitor's value (None with nothing to measure), the counts the
        minimums read, and the commonest openings and replies (for a person reading an alarm)."""
        text = self.text_summary()
        n = len(self.word_counts)
        return {
            "mean_words": round(sum(self.word_counts) / n, degeneration.MEAN_DIGITS) if n else None,
            "empty_share": text["empty_share"],
            "one_word_share": text["one_word_share"],
            "repeated_opening_share": text["repeated_opening_share"],
            "top_reply_share": text["top_reply_share"],
            "distinct_2": text["distinct_2"],
            "refusal_share": _share(self.refusals, self.replies),
            "tool_error_share": _share(self.tool_errors, self.tool_turns),
            "reward_mean": _mean(self.reward_sum, self.judgements),
            "hint_share": _share(self.hints, self.judgements),
            "kl": _mean(self.kl_sum, self.kl_steps),
            "entropy": _mean(self.entropy_sum, self.entropy_steps),
            "replies": self.replies, "judgements": self.judgements, "steps": self.steps,
            "window": len(self.texts), "turns": self.turns, "skipped": self.skipped,
            "tool_turns": self.tool_turns, "kl_steps": self.kl_steps, "entropy_steps": self.entropy_steps,
            "top_openings": text["top_openings"], "top_replies": text["top_replies"],
        }


# --- drift ---------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Alarm:
    monitor: str
    action: str            # "alarm", "halt" or "rollback"
    value: float
    baseline: float
    threshold: float
    detail: str            # one line for a person: "one_word_share 4% -> 62%: rose by more than 20 points"

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def _show(x: float, unit: str) -> str:
    if unit == "share":
        return f"{x:.0%}"
    return f"{x:.2f} nats" if unit == "nats" else f"{x:.2f}"


def _resolve(rule: MonitorRule | None, name: str) -> tuple[str, float]:
    """(action, threshold); a missing rule, "default" or a 0 threshold is the monitor's own, as
    MonitorsConfig resolves them: a monitor left out of `rules` stays on, not off."""
    action, threshold = DEFAULT_RULES[name]
    if rule is None:
        return action, threshold
    return (action if rule.action == "default" else rule.action), (rule.threshold or threshold)


def _drifted(m: Monitor, now: float, base: float, t: float) -> str | None:
    """Why `now` drifted from `base` past threshold t, or None. Differences are rounded to 9 digits so
    that a value exactly at the threshold (0.3 − 0.1 is 0.19999999999999998) does not count as past it."""
    if m.kind == "rise" and round(now - base, 9) > t:
        what = f"{round(t * 100, 6):g} points" if m.unit == "share" else f"{t:g}"
        return f"rose by more than {what}"
    if m.kind == "fall" and round(base - now, 9) > t:
        return f"fell by more than {t:g}"
    if m.kind == "moves" and base > 0 and round(abs(now - base), 9) > round(t * base, 9):
        return f"moved by more than {t:.0%} of the baseline's"
    if m.kind == "keeps" and base > 0 and round(now, 9) < round((1 - t) * base, 9):
        return f"under {1 - t:.0%} of the baseline's"
    return None


def drift(now: Mapping[str, Any], baseline: Mapping[str, Any], rules: Mapping[str, MonitorRule],
          min_replies: int) -> list[Alarm]:
    """The alarms of `now` (a version's `Tally.summary()`) against `baseline` (the pooled baseline's),
    in MONITORS order. A monitor says nothing when its action is "off", when either side's value is
    None, or when either side has too little of what it counts: fewer than min_replies replies (text
    monitors, refusals), tool turns (tool errors) or judgements (reward, hints); no step with the metric
    (kl, entropy). Relative rules (mean_words, distinct_2, entropy) need a positive baseline."""
    out = []
    for name, m in MONITORS.items():
        action, t = _resolve(rules.get(name), name)
        if action not in ACTION_RANK:
            continue
        least = 1 if m.count.endswith("_steps") else min_replies
        if (now.get(m.count) or 0) < least or (baseline.get(m.count) or 0) < least:
            continue
        value, base = now.get(name), baseline.get(name)
        if value is None or base is None:
            continue
        why = _drifted(m, value, base, t)
        if why is not None:
            out.append(Alarm(name, action, value, base, t,
                             f"{name} {_show(base, m.unit)} -> {_show(value, m.unit)}: {why}"))
    return out


def worst(alarms: Iterable[Alarm]) -> str | None:
    """The strongest action among `alarms` ("rollback" > "halt" > "alarm"), None for none."""
    return max((a.action for a in alarms), key=ACTION_RANK.__getitem__, default=None)


# --- the daemon's holder -------------------------------------------------------------------------

class Monitors:
    """Tallies per version, fed by the daemon, and the check of one version against its baseline.
    Bounded: at most `keep` versions, the least recently observed dropped first (a version served
    again after a rollback is recent again, however old its number)."""

    def __init__(self, cfg: MonitorsConfig, *, keep: int = VERSIONS_KEPT, cap: int = TEXTS_KEPT):
        self.cfg, self.keep, self.cap = cfg, keep, cap
        self._tallies: OrderedDict[int, Tally] = OrderedDict()
        self._pool: tuple[tuple, dict[str, Any]] | None = None  # the baseline's text summary, by its tallies

    def _tally(self, version: int) -> Tally:
        tally = self._tallies.get(version)
        if tally is None:
            tally = self._tallies[version] = Tally(self.cap)
            while len(self._tallies) > self.keep:
                self._tallies.popitem(last=False)
        self._tallies.move_to_end(version)
        return tally

    def observe_turn(self, version: int, record: Mapping[str, Any], keep_text: bool = True) -> None:
        """One turn record (`FinishedTurn.to_record()`) served by `version`; keep_text False for a principal
        whose turns are not recorded: counted, its words never kept."""
        _, text = degeneration.reply_of(record)
        self._tally(version).add_turn(
            text, finish_reason=record.get("finish_reason"), response_tokens=len(record.get("response_ids") or ()),
            tools_offered=bool(record.get("tools")), tool_error=tool_call_error(record),
            owner=str(record.get("principal", "")) if keep_text else None, session=record.get("session_id"))

    def forget_principal(self, principal: str) -> int:
        """Every kept reply text of `principal` dropped from every version's tally; how many went."""
        self._pool = None
        return sum(t.forget(principal) for t in self._tallies.values())

    def observe_judgement(self, version: int, reward: float, has_hint: bool) -> None:
        self._tally(version).add_judgement(reward, has_hint)

    def observe_sample(self, sample) -> None:
        """A scored sample (clawd.samples.Sample): a live turn's judge verdict counts; an active rollout's
        score does not (a checker's number on another scale, from no user: it would move reward_mean whenever
        rollouts start or stop)."""
        if sample.source == "live":
            self.observe_judgement(sample.policy_version, sample.reward, sample.has_hint)

    def observe_step(self, version: int, metrics: Mapping[str, Any]) -> None:
        self._tally(version).add_step(metrics)

    def baseline(self, version: int, clean_versions: list[int]) -> Tally:
        """The pooled tallies of the last cfg.baseline_versions of `clean_versions` (in the order
        given: oldest first) other than `version`; versions with no tally here add nothing."""
        picked = [v for v in clean_versions if v != version][-self.cfg.baseline_versions:]
        tallies = [self._tallies[v] for v in picked if v in self._tallies]
        for v in picked:  # in use: not the least recently observed, whatever its age
            if v in self._tallies:
                self._tallies.move_to_end(v)
        pooled = Tally.pooled(tallies)
        key = tuple((t.uid, t.text_revision) for t in tallies)
        if self._pool is not None and self._pool[0] == key:  # the clean versions rarely get new replies
            pooled._text = self._pool[1]
        else:
            self._pool = key, pooled.text_summary()
        return pooled

    def check(self, version: int, clean_versions: list[int]) -> list[Alarm]:
        """`version`'s alarms against its baseline; none when monitors are disabled or it has no tally."""
        if not self.cfg.enabled or version not in self._tallies:
            return []
        return drift(self._tallies[version].summary(), self.baseline(version, clean_versions).summary(),
                     self.cfg.rules(), self.cfg.min_replies)

    def snapshot(self) -> dict[int, dict[str, Any]]:
        """{version: its summary}, versions in ascending order, for the status page and dashboard."""
        return {v: self._tallies[v].summary() for v in sorted(self._tallies)}

    def snapshot_of(self, version: int) -> dict[str, Any]:
        """One version's summary; {} when nothing was observed of it."""
        tally = self._tallies.get(version)
        return {} if tally is None else tally.summary()

    def forget(self, version: int) -> None:
        self._tallies.pop(version, None)
