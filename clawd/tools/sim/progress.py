"""The demo's live progress (clawd.tools.sim.demo): a status line, one line per finished version, and
what the gate and the monitors decided about each version as it happens."""
from __future__ import annotations

import sys
import time

from clawd.safety import degeneration
from clawd.ops.ctl import NotRunning
from clawd.tools.sim.launch import Clawd
from clawd.tools.sim.users import Users, by_version, rate


def clock(seconds: float) -> str:
    return f"{int(seconds // 60):2d}:{int(seconds % 60):02d}"


def pct(x: float | None) -> str:
    return "  - " if x is None else f"{100 * x:3.0f}%"


def fmt(x: float | None) -> str:
    return "-" if x is None else f"{x:.2f}"


class Judged:
    """The judge's rewards per policy version, from clawd's turn and judge records (read as they grow)."""

    def __init__(self, clawd: Clawd):
        self.clawd = clawd
        self.version: dict[tuple[str, int], int] = {}      # (session, turn) -> policy version
        self.rewards: list[tuple[tuple[str, int], float]] = []

    def refresh(self) -> None:
        self.version = {(r["session_id"], r["turn_index"]): r["policy_version"] for r in self.clawd.records("turns")}
        self.rewards = [((r["session_id"], r["turn_index"]), float(r["reward"]))
                        for r in self.clawd.records("judge") if r.get("emitted")]

    def by_version(self) -> dict[int, dict[str, float]]:
        out: dict[int, list[float]] = {}
        for key, reward in self.rewards:
            if key in self.version:
                out.setdefault(self.version[key], []).append(reward)
        return {v: {"samples": len(r), "reward": sum(r) / len(r)} for v, r in sorted(out.items())}


class Display:
    """Live progress: one status line (redrawn in place on a terminal) and one line per finished version."""

    def __init__(self, users: Users, clawd: Clawd, judged: Judged, started: float, mode: str):
        self.users, self.clawd, self.judged, self.started, self.mode = users, clawd, judged, started, mode
        self.tty = sys.stdout.isatty()
        self.version = 0
        self.last_line = 0.0
        self.status: dict = {}
        self.seen: dict[int, tuple] = {}  # version -> (status, gate verdict, alarms) last printed
        self.events: list[str] = []       # the gate's and the monitors' decisions, as printed

    def poll(self) -> None:
        try:
            self.status = self.clawd.status()
        except (NotRunning, OSError) as exc:
            raise RuntimeError(f"clawd's admin socket stopped answering ({exc}); its log:\n{self.clawd.tail()}") from None
        version = self.status["policy"]["version"]
        if version != self.version:
            self.judged.refresh()
            for v in range(self.version, version):
                self.finished(v, version)
            self.version = version
        self.safety()
        self.line()

    def safety(self) -> None:
        """The gate's verdicts and the monitors' alarms and rollbacks (clawctl versions), each once."""
        try:
            listing = self.clawd.command("versions", last=50)["versions"]
        except (NotRunning, OSError, ValueError) as exc:
            raise RuntimeError(f"clawd's admin socket stopped answering ({exc})") from None
        for v in listing:
            gate, monitors = v.get("gate") or {}, v.get("monitors") or {}
            alarms = tuple(f"{a['detail']} -> {a['action']}" for a in monitors.get("alarms") or [])
            key = (v["status"], gate.get("detail") if "diff" in gate else None, alarms)
            before = self.seen.get(v["version"], (None, None, ()))
            self.seen[v["version"]] = key
            lines = []
            if key[1] is not None and key[1] != before[1]:
                lines.append(f"v{v['version']} gate {'passed' if gate.get('passed') else 'REJECTED'}: {key[1]}")
            lines += [f"v{v['version']} monitors: {a}" for a in alarms if a not in before[2]]
            if v["status"] == "rolled_back" and before[0] != "rolled_back":
                lines.append(f"v{v['version']} rolled back: {v.get('detail', '')}")
            if v.get("restored_from") is not None and before[0] is None:
                lines.append(f"v{v['version']} serves v{v['restored_from']}'s weights again")
            for text in lines:
                if self.tty:
                    print("\r\033[K", end="")
                print(f"{clock(time.monotonic() - self.started)}  {text}", flush=True)
                self.events.append(text)

    def finished(self, v: int, now_serving: int) -> None:
        row = by_version(self.users.replies).get(v)
        judge = self.judged.by_version().get(v)
        if self.tty:
            print("\r\033[K", end="")
        if row is None:
            print(f"{clock(time.monotonic() - self.started)}  v{v} -> v{now_serving}: no answers served by v{v}")
            return
        personas = "  ".join(f"{p} {pct(s)}" for p, s in row["personas"].items())
        reward = f"{judge['reward']:+.2f} over {judge['samples']} samples" if judge else "-"
        shape = degeneration.summarise(r.text for r in self.users.replies if r.kind == "answer" and r.version == v)
        print(f"{clock(time.monotonic() - self.started)}  v{v} -> v{now_serving}: {row['answers']:3d} answers, "
              f"satisfied {pct(row['satisfied'])} = correct {pct(row['correct'])} and styled {pct(row['styled'])}"
              f" (first try {pct(row['first_try'])}), judge reward {reward}, {shape['mean_words']:.0f} words,"
              f" distinct-2 {fmt(shape['distinct_2'])}  | {personas}", flush=True)

    def line(self, force: bool = False) -> None:
        now = time.monotonic()
        if not self.tty and not force and now - self.last_line < 15:
            return
        self.last_line = now
        st = self.status
        learner = st.get("learner") or {}
        queue, scoring = st["queue"], st["scoring"]
        recent = [r for r in self.users.replies if r.kind == "answer"][-40:]
        corrections = sum(1 for r in self.users.replies if r.satisfied is False)
        hints = (f"hints {scoring['hints_accepted']}/{corrections} corrections" if self.mode != "rl"
                 else "hints unused (rl)")
        text = (f"{clock(now - self.started)}  v{st['policy']['version']}  steps {learner.get('steps', 0)}"
                f"  batch {queue['effective']}/{queue['batch_size']}  sessions {len(self.users.sessions)}"
                f" (live {st['sessions']['live']})  answers {sum(1 for r in self.users.replies if r.kind == 'answer')}"
                f"  satisfied, last 40: {pct(rate(recent))}  {hints}")
        if self.tty:
            print("\r\033[K" + text, end="", flush=True)
        else:
            print(text, flush=True)

    def done(self) -> None:
        if self.tty:
            print()
