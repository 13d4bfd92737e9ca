"""How often the event loop ran something else while a test awaited a long piece of work: a task that counts
its turns stands for a chat request or a health poll waiting its turn. A step that holds the loop whole lets
it run no turn at all."""
from __future__ import annotations

import asyncio


class LoopTurns:
    """`async with LoopTurns() as turns: ...`; `turns.count` is the turns taken so far."""

    def __init__(self) -> None:
        self.count = 0
        self._task: asyncio.Task | None = None

    async def __aenter__(self) -> "LoopTurns":
        self._task = asyncio.create_task(self._turn())
        await asyncio.sleep(0)  # started before the work it stands beside
        return self

    async def __aexit__(self, *exc) -> None:
        self._task.cancel()

    async def _turn(self) -> None:
        while True:
            self.count += 1
            await asyncio.sleep(0)
