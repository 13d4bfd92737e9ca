"""Simulated users: personas talking to a running clawd through the official `openai` client.

Every session belongs to one persona and is planned from the seed alone
(`plan_sessions`), so two runs with one seed ask the same questions in the same
sessions. Sessions differ in how clawd learns who they are and how they end,
cycling through all four combinations:

    stitched          no custom header at all: clawd stitches the session from the
                      conversation itself; the user walks away (idle timeout)
    stitched_done     no session id; the last request says `X-Session-Done: 1`
    headed            `X-Session-Id` on every request, ending with `X-Session-Done`
    headed_abandoned  `X-Session-Id`, and the user walks away

Some sessions offer the model a `lookup` tool and answer its calls with a tool
message; some are streamed. Each session is a distinct end user (the body's
standard `user` field), so two sessions that open with the same question are
never taken for one conversation regenerated.

A session asks its questions in turn. The user's next message carries the verdict
on the reply before it (`personas.follow_up`): thanks and the next question, or a
correction, after which the same question is answered again (`retries` times at
most). A session that ends with `X-Session-Done` sends its last verdict with that
header (a one-token closing reply); an abandoned one leaves its last reply
unjudged. Every reply is kept as a `Reply`: persona, verdict, the policy version
that served it (`system_fingerprint` "clawd-vN").
"""
from __future__ import annotations

import asyncio
import json
import logging
import random
import re
import time
from dataclasses import asdict, dataclass
from typing import Any, Callable, Iterator, Mapping, Sequence

import openai

from clawd.tools.sim.personas import Grade, Persona, follow_up
from clawd.tools.sim.questions import CORRECT

log = logging.getLogger("clawd.sim")

IDENTITIES = ("stitched", "headed")
ENDINGS = ("done", "abandoned")
# identity × ending, in the order sessions cycle through them
STYLES = (("stitched", "abandoned"), ("headed", "done"), ("stitched", "done"), ("headed", "abandoned"))
STYLE_NAMES = {("stitched", "abandoned"): "stitched", ("headed", "done"): "headed",
               ("stitched", "done"): "stitched_done", ("headed", "abandoned"): "headed_abandoned"}
MAX_TOOL_ROUNDS = 2  # tool calls answered per question before the user wants a text answer

TOOLS = [{"type": "function", "function": {
    "name": "lookup", "description": "Look a topic up in the encyclopedia.",
    "parameters": {"type": "object", "properties": {"query": {"type": "string", "description": "the topic"}},
                   "required": ["query"]}}}]

_FINGERPRINT = re.compile(r"clawd-v(\d+)")


def version_of(fingerprint: str | None) -> int | None:
    """The policy version in clawd's `system_fingerprint` ("clawd-v3" → 3), None without one."""
    m = _FINGERPRINT.fullmatch(fingerprint or "")
    return int(m.group(1)) if m else None


def tool_result(name: str | None, arguments: str | None) -> str:
    """The content of the tool message answering one call (an error object for a bad call)."""
    if name != "lookup":
        return json.dumps({"error": f"unknown tool {name!r}"})
    try:
        args = json.loads(arguments or "")
    except ValueError:
        return json.dumps({"error": "arguments are not JSON"})
    if not isinstance(args, dict) or not isinstance(args.get("query"), str) or not args["query"].strip():
        return json.dumps({"error": "lookup needs a query"})
    query = args["query"].strip()
    return json.dumps({"query": query, "summary": f"The encyclopedia has a short article on {query}."})


@dataclass(frozen=True)
class SessionPlan:
    index: int
    persona: Persona
    identity: str          # "stitched" | "headed"
    ending: str            # "done" | "abandoned"
    tools: bool
    stream: bool
    questions: tuple[str, ...]
    retries: int
    seed: int

    @property
    def style(self) -> str:
        return STYLE_NAMES[(self.identity, self.ending)]

    @property
    def user(self) -> str:
        """The end user's name (the body's `user` field): one per session."""
        return f"sim-{self.seed}-{self.index}-{self.persona.name}"

    @property
    def session_id(self) -> str | None:
        return f"sim-{self.seed}-{self.index}" if self.identity == "headed" else None

    def headers(self, *, closing: bool = False) -> dict[str, str]:
        headers = {"X-Session-Id": self.session_id} if self.session_id else {}
        if closing:
            headers["X-Session-Done"] = "1"
        return headers

    def request_seed(self, request: int) -> int:
        """The sampling seed of this session's n-th request (replays draw the same tokens)."""
        return (self.seed * 1_000_003 + self.index * 1_009 + request) % 2**31


def plan_sessions(personas: Sequence[Persona], *, seed: int, questions: tuple[int, int] = (1, 3), retries: int = 1,
                  tool_share: float = 0.25, stream_share: float = 0.25) -> Iterator[SessionPlan]:
    """Sessions without end: personas round-robin, each persona through all four STYLES in turn,
    tools and streaming drawn from the seed (tool sessions are not streamed)."""
    if not personas:
        raise ValueError("no personas")
    lo, hi = questions
    if not 1 <= lo <= hi:
        raise ValueError(f"questions per session must be 1 <= lo <= hi, got {questions}")
    rng = random.Random(seed)
    index = 0
    while True:
        persona = personas[index % len(personas)]
        identity, ending = STYLES[(index // len(personas)) % len(STYLES)]
        tools = rng.random() < tool_share
        stream = not tools and rng.random() < stream_share
        k = min(rng.randint(lo, hi), len(persona.questions))
        yield SessionPlan(index, persona, identity, ending, tools, stream,
                          tuple(rng.sample(persona.questions, k)), retries, seed)
        index += 1


@dataclass(frozen=True)
class Reply:
    """One reply a simulated user got, and what the user made of it."""
    session: int
    persona: str
    style: str
    kind: str                 # "answer", "tool_call", "closing" (the one-token reply to X-Session-Done), "probe"
    turn: int                 # the request's number within its session
    question: int
    attempt: int              # 0: first answer to the question; n: after n corrections
    version: int | None       # the policy version that served it
    satisfied: bool | None    # None: not a text answer (a tool call, a closing reply)
    words: int
    tokens: int
    finish: str | None
    seconds: float
    text: str = ""
    correct: bool | None = None  # the right answer is there (substance personas' text answers only)
    styled: bool | None = None   # the persona's style holds (text answers only)

    @property
    def reward(self) -> int | None:
        """The reward the rules judge gives this reply from the user's verdict (+1 thanks, -1 correction)."""
        return None if self.satisfied is None else (1 if self.satisfied else -1)

    def to_json(self) -> dict[str, Any]:
        return {**asdict(self), "reward": self.reward}


@dataclass(frozen=True)
class _Served:
    message: dict[str, Any]  # the assistant message, as a client sends it back
    text: str
    tool_calls: list[dict[str, Any]]
    version: int | None
    tokens: int
    finish: str | None
    seconds: float


RETRY_AFTER_MAX = 30.0  # seconds a user waits at most when told to come back later


def retry_after(headers: Mapping[str, str]) -> float:
    """How long a 429 or 503 with these (case-insensitive) headers asks a client to wait: its Retry-After
    seconds, 1 without one, at most RETRY_AFTER_MAX."""
    try:
        wait = float(headers.get("retry-after", 1))
    except ValueError:  # an HTTP date: not what clawd sends
        wait = 1.0
    return min(max(wait, 0.0), RETRY_AFTER_MAX)


class Users:
    """Simulated users against one clawd: `run` drives sessions until told to stop.

    `gate` (set by default) is awaited before every request: clearing it holds all
    users between requests (bench/learning.py does, to evaluate between steps).
    """

    def __init__(self, base_url: str, personas: Sequence[Persona], *, seed: int = 0, concurrency: int = 4,
                 max_tokens: int = 64, temperature: float = 1.0, retries: int = 1, questions: tuple[int, int] = (1, 3),
                 tool_share: float = 0.25, stream_share: float = 0.25, api_key: str = "none", timeout: float = 600,
                 keep_text: bool = False, principal_of: Callable[[Persona], str] | None = None):
        """principal_of: the `user` field every request of a persona carries, its probes' included (one principal
        per persona, with [auth] trust_user_field: adapters per principal); None: one per session, and probes
        as "sim-probe"."""
        if concurrency < 1:
            raise ValueError("concurrency must be at least 1")
        self.client = openai.AsyncOpenAI(base_url=base_url.rstrip("/") + "/v1", api_key=api_key, max_retries=0,
                                         timeout=timeout)
        self.personas = list(personas)
        self.concurrency = concurrency
        self.max_tokens = max_tokens
        self.temperature = temperature
        self.keep_text = keep_text
        self.principal_of = principal_of
        self.plans = plan_sessions(self.personas, seed=seed, questions=questions, retries=retries,
                                   tool_share=tool_share, stream_share=stream_share)
        self.replies: list[Reply] = []
        self.sessions: list[SessionPlan] = []      # started, in order
        self.ended: dict[str, int] = {}            # how sessions ended: done, abandoned, stopped, error
        self.errors: list[str] = []
        self.gate = asyncio.Event()
        self.gate.set()
        self._stopping = False
        self.in_flight = 0  # requests sent and not yet answered

    # ---- running ------------------------------------------------------------------------------

    async def run(self, until: Callable[[], bool] = lambda: False) -> None:
        """Run `concurrency` users, each one session after another, until `until()` or `stop()`.
        A session stopped half-way is left to clawd's idle timeout."""
        async def worker() -> None:
            while not self._stopping and not until():
                await self.session(next(self.plans))
        await asyncio.gather(*(worker() for _ in range(self.concurrency)))

    def stop(self) -> None:
        """No new request after the ones in flight; sessions are left where they are."""
        self._stopping = True
        self.gate.set()

    async def quiet(self, poll: float = 0.05) -> None:
        """Wait until no request is in flight (with the gate cleared, none will start)."""
        while self.in_flight:
            await asyncio.sleep(poll)

    async def close(self) -> None:
        await self.client.close()

    async def session(self, plan: SessionPlan) -> None:
        """One whole session; an API error ends it (counted in `errors`), it never raises. Told to come back
        later (429, 503), the user waits its Retry-After before the next session, as a person would: users
        that hammer a restarting engine turn seconds of downtime into thousands of errors."""
        self.sessions.append(plan)
        try:
            self._end(await self._converse(plan))
        except openai.APIError as exc:
            self.errors.append(f"session {plan.index}: {type(exc).__name__}: {exc}")
            log.warning("session %d: %s", plan.index, exc)
            self._end("error")
            if getattr(exc, "status_code", None) in (429, 503):  # told to come back later: a person waits
                await asyncio.sleep(retry_after(exc.response.headers))

    def _end(self, how: str) -> None:
        self.ended[how] = self.ended.get(how, 0) + 1

    async def _converse(self, plan: SessionPlan) -> str:
        persona = plan.persona
        messages: list[dict[str, Any]] = [{"role": "user", "content": plan.questions[0]}]
        q, attempt, tool_rounds, turn = 0, 0, 0, 0
        while True:
            await self.gate.wait()
            if self._stopping:
                return "stopped"
            served = await self._ask(plan, messages, turn)
            turn += 1
            if served.tool_calls and tool_rounds < MAX_TOOL_ROUNDS:
                tool_rounds += 1
                self._keep(plan, "tool_call", served, turn, q, attempt, None)
                messages += [served.message] + [
                    {"role": "tool", "tool_call_id": call.get("id") or f"call_{turn}_{i}",
                     "content": tool_result(call["function"].get("name"), call["function"].get("arguments"))}
                    for i, call in enumerate(served.tool_calls)]
                continue
            question = plan.questions[q]  # substance personas judge the answer to this question, not form alone
            grade = persona.grade(served.text, question)
            retry = not grade.satisfied and attempt < plan.retries
            next_q = None if retry or q + 1 >= len(plan.questions) else plan.questions[q + 1]
            ok, said = follow_up(persona, served.text, next_question=next_q, retry=retry, i=plan.index + turn,
                                 question=question)
            self._keep(plan, "answer", served, turn, q, attempt, ok, grade)
            messages.append(served.message)
            if retry:
                attempt += 1
            else:
                q, attempt, tool_rounds = q + 1, 0, 0
            if retry or next_q is not None:
                messages.append({"role": "user", "content": said})
                continue
            if plan.ending == "abandoned":
                return "abandoned"
            # The last verdict closes the session; its own reply is never judged: one token will do.
            await self.gate.wait()
            messages.append({"role": "user", "content": said})
            closing = await self._ask(plan, messages, turn, closing=True)
            self._keep(plan, "closing", closing, turn + 1, q, 0, None)
            return "done"

    async def _ask(self, plan: SessionPlan, messages: list[dict[str, Any]], turn: int, *,
                   closing: bool = False) -> _Served:
        kwargs: dict[str, Any] = dict(
            model="clawd", messages=messages, temperature=self.temperature,
            user=plan.user if self.principal_of is None else self.principal_of(plan.persona),
            max_tokens=1 if closing else self.max_tokens, seed=plan.request_seed(turn),
            extra_headers=plan.headers(closing=closing))
        if plan.tools:
            kwargs["tools"] = TOOLS
        self.in_flight += 1
        try:
            if plan.stream and not closing:
                return await self._streamed(kwargs)
            return await self._whole(kwargs)
        finally:
            self.in_flight -= 1

    async def _whole(self, kwargs: dict[str, Any]) -> _Served:
        started = time.monotonic()
        reply = await self.client.chat.completions.create(**kwargs)
        choice = reply.choices[0]
        calls = [c.model_dump() for c in choice.message.tool_calls or []]
        return _Served(choice.message.model_dump(exclude_none=True), choice.message.content or "", calls,
                       version_of(reply.system_fingerprint), reply.usage.completion_tokens if reply.usage else 0,
                       choice.finish_reason, time.monotonic() - started)

    async def _streamed(self, kwargs: dict[str, Any]) -> _Served:
        started = time.monotonic()
        stream = await self.client.chat.completions.create(**kwargs, stream=True,
                                                           stream_options={"include_usage": True})
        parts, version, finish, tokens = [], None, None, 0
        async for chunk in stream:
            version = version_of(chunk.system_fingerprint) if chunk.system_fingerprint else version
            if chunk.usage:
                tokens = chunk.usage.completion_tokens
            for choice in chunk.choices:
                parts.append(choice.delta.content or "")
                finish = choice.finish_reason or finish
        text = "".join(parts)
        return _Served({"role": "assistant", "content": text}, text, [], version, tokens, finish,
                       time.monotonic() - started)

    def _keep(self, plan: SessionPlan, kind: str, served: _Served, turn: int, q: int, attempt: int,
              satisfied: bool | None, grade: Grade | None = None) -> None:
        reply = Reply(plan.index, plan.persona.name, plan.style, kind, turn, q, attempt, served.version,
                      satisfied, len(served.text.split()), served.tokens, served.finish, round(served.seconds, 3),
                      served.text if self.keep_text else "", *_split(grade))
        self.replies.append(reply)

    # ---- probes -------------------------------------------------------------------------------

    async def probe(self, persona: Persona, question: int, seed: int, *, greedy: bool = False) -> Reply:
        """One evaluation request: the persona's question alone, a fixed sampling seed (or greedy: temperature
        0), never trained on. Its `style` says which: "sampled" or "greedy".

        A side turn (`X-Turn-Type: side`) as well as `X-Clawd-No-Train`: side turns stay out of the
        session table, so probes that repeat a question never touch the users' sessions."""
        started = time.monotonic()
        text = persona.probe_question(question)  # held-out questions (or paraphrases): never asked as such
        reply = await self.client.chat.completions.create(
            model="clawd", messages=[{"role": "user", "content": text}],
            temperature=0.0 if greedy else self.temperature,
            max_tokens=self.max_tokens, seed=seed,
            user="sim-probe" if self.principal_of is None else self.principal_of(persona),
            extra_headers={"X-Clawd-No-Train": "1", "X-Turn-Type": "side"})
        content = reply.choices[0].message.content or ""
        grade = persona.grade(content, text)
        return Reply(-1, persona.name, "greedy" if greedy else "sampled", "probe", 0, question, 0,
                     version_of(reply.system_fingerprint), grade.satisfied, len(content.split()),
                     reply.usage.completion_tokens if reply.usage else 0, reply.choices[0].finish_reason,
                     round(time.monotonic() - started, 3), content if self.keep_text else "", *_split(grade))

    async def evaluate(self, probes_per_persona: int, *, seed: int = 7, greedy: bool = False,
                       personas: Sequence[Persona] | None = None, concurrency: int | None = None) -> list[Reply]:
        """The fixed evaluation set: the first `probes_per_persona` questions of every persona (of
        `personas`, default the users' own; cycled if it has fewer), each with its own fixed seed (or
        greedy), `concurrency` (default the users') at a time."""
        limit = asyncio.Semaphore(concurrency or self.concurrency)

        async def one(p: Persona, i: int) -> Reply:
            async with limit:
                return await self.probe(p, i, seed * 100_003 + i, greedy=greedy)
        return list(await asyncio.gather(*(one(p, i) for p in (personas or self.personas)
                                           for i in range(probes_per_persona))))


# ---- summaries (pure) ---------------------------------------------------------------------------

def _split(grade: Grade | None) -> tuple[bool | None, bool | None]:
    """(correct, styled) of a graded text answer; correct is None for a form-only persona."""
    if grade is None:
        return None, None
    return (None if grade.answer is None else grade.answer == CORRECT), grade.styled


def rate(replies: Sequence[Reply], of: str = "satisfied") -> float | None:
    """Share of replies with `of` ("satisfied", "correct" or "styled") true, among those where it was
    judged; None when there are none."""
    judged = [getattr(r, of) for r in replies if getattr(r, of) is not None]
    return sum(judged) / len(judged) if judged else None


def by_version(replies: Sequence[Reply]) -> dict[int, dict[str, Any]]:
    """Per policy version: answers, satisfaction rate, mean reward, first-try satisfaction, per persona."""
    out: dict[int, dict[str, Any]] = {}
    answers = [r for r in replies if r.kind == "answer" and r.version is not None]
    for v in sorted({r.version for r in answers}):
        mine = [r for r in answers if r.version == v]
        first = [r for r in mine if r.attempt == 0]
        out[v] = {"answers": len(mine), "satisfied": rate(mine), "correct": rate(mine, "correct"),
                  "styled": rate(mine, "styled"), "reward": sum(r.reward for r in mine) / len(mine),
                  "first_try": rate(first), "first_try_answers": len(first),
                  "personas": {p: rate([r for r in mine if r.persona == p])
                               for p in sorted({r.persona for r in mine})}}
    return out


def by_persona(replies: Sequence[Reply]) -> dict[str, dict[str, Any]]:
    """Per persona: judged replies, satisfaction rate, mean words."""
    out = {}
    for p in sorted({r.persona for r in replies}):
        mine = [r for r in replies if r.persona == p and r.satisfied is not None]
        out[p] = {"n": len(mine), "satisfied": rate(mine), "correct": rate(mine, "correct"),
                  "styled": rate(mine, "styled"), "words": sum(r.words for r in mine) / len(mine) if mine else None}
    return out
