"""A journal writer for the SIGKILL test: `python -S tests/journal_writer.py DIR SEED FSYNC`.

Replays DIR, prints "ready", then appends and acks for ever from a few
concurrent tasks (group commit), printing "A id" after each append returns,
"k id" before an ack starts and "K id" after it returns. Each line goes out
with one os.write, so the parent sees exactly what was acknowledged before
the kill. The test forks and calls `run` directly (an exec per kill point
would spend most of the test importing asyncio); the command line is the same code.
"""
import asyncio
import os
import random
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # runs with -S, no site

from clawd.learning.journal import Journal  # noqa: E402


async def worker(journal: Journal, rng: random.Random, prefix: str, live: list[str], say) -> None:
    for k in range(10**9):
        entry_id = f"{prefix}-{k}"
        await journal.append(entry_id, rng.randbytes(rng.randrange(0, 300)))
        say(f"A {entry_id}")
        live.append(entry_id)
        if rng.random() < (0.3 if len(live) < 200 else 0.9):  # keeps about 200 live entries
            victim = live.pop(rng.randrange(len(live)))
            say(f"k {victim}")  # from here on the parent cannot know whether it is still live
            await journal.ack([victim])
            say(f"K {victim}")
            journal.compact()
        await asyncio.sleep(rng.choice([0, 0, 0.0002, 0.001]))


async def run(directory: str, seed: str, fsync: str, out: int = 1) -> None:
    def say(line: str) -> None:
        os.write(out, (line + "\n").encode())

    rng = random.Random(seed)
    journal = Journal(directory, fsync=fsync, fsync_interval=0.005, segment_bytes=2048)
    live = [entry_id for entry_id, _ in journal.open()]
    say("ready")
    await asyncio.gather(*(worker(journal, rng, f"{seed}.{w}", live, say) for w in range(3)))


if __name__ == "__main__":
    asyncio.run(run(*sys.argv[1:4]))
