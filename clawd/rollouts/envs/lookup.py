"""The lookup environment: answer a question from a small fact table that only a tool can read, whose keys
must be written its way (docs/ARCHITECTURE.md §19). Recovering from an error is the skill it trains: a key
written another way ("Population of Norway") gets an error naming the form the table wants
("country:field", e.g. "norway:population") and the fields it has, and the model tries again.

`Lookup.reset(seed)` draws a (country, field) question from the seed; `lookup(key)` answers one entry; the
episode ends with a reply, rewarded 1 when it holds the entry's value (its number within 0.5 %, or its text
as the gate reads text).
"""
from __future__ import annotations

import random
import re

from clawd.rollouts.tasks import final_number
from clawd.safety.evalset import appears

# A fixed table, made up where a model's memory would answer instead of the tool: the tool is the only way.
COUNTRIES = ("norway", "chile", "kenya", "japan", "peru", "spain", "egypt", "canada", "india", "brazil",
             "poland", "ghana", "nepal", "oman", "fiji", "chad")
FIELDS = ("population", "capital", "area", "founded")
_CAPITALS = ("Vesterholm", "Quintara", "Mbarani", "Kaseto", "Andaluz", "Corveno", "Sekhet", "Maplewood",
             "Devgarh", "Solmira", "Wistrow", "Akuapem", "Himkot", "Zafira", "Nadroga", "Bahr Lak")
KEY = re.compile(r"[a-z]+:[a-z]+")

LOOKUP_TOOLS = [{"type": "function", "function": {
    "name": "lookup", "description": "Read one entry of the fact table by its key.",
    "parameters": {"type": "object", "properties": {"key": {"type": "string"}}, "required": ["key"]}}}]


def table() -> dict[str, str]:
    """Every entry, "country:field" -> value (the same on every call: seeded by nothing but its own constant)."""
    rng, out = random.Random(20261204), {}
    for country, capital in zip(COUNTRIES, _CAPITALS):
        out[f"{country}:population"] = str(rng.randrange(1_000_000, 90_000_000))
        out[f"{country}:capital"] = capital
        out[f"{country}:area"] = str(rng.randrange(10_000, 2_000_000))
        out[f"{country}:founded"] = str(rng.randrange(1700, 1990))
    return out


class Lookup:
    tools = LOOKUP_TOOLS

    def __init__(self):
        self.table = table()

    def reset(self, seed: int) -> str:
        rng = random.Random(seed)
        self.country, self.field = rng.choice(COUNTRIES), rng.choice(FIELDS)
        self.value = self.table[f"{self.country}:{self.field}"]
        name = self.country.title()
        question = {"population": f"What is the population of {name}?", "capital": f"What is the capital of {name}?",
                    "area": f"What is the area of {name}, in square kilometres?",
                    "founded": f"In what year was {name} founded?"}[self.field]
        return f"{question} Look it up in the fact table with the lookup tool, then answer."

    def step(self, action: dict) -> tuple[str, float, bool, dict]:
        if "answer" in action:
            text = action["answer"]
            if self.value.isdigit():
                got = final_number(text)
                right = got is not None and abs(got - int(self.value)) <= 0.005 * int(self.value)
            else:
                right = appears(self.value, text)
            return ("Correct." if right else "Not correct."), float(right), True, {"value": self.value}
        if action.get("tool") != "lookup":
            return f"error: there is no tool named {action.get('tool')!r}; the tool is lookup", 0.0, False, \
                {"error": True}
        key = action.get("arguments", {}).get("key")
        if not isinstance(key, str) or not KEY.fullmatch(key):
            return (f"error: {key!r} is not a key; keys are written country:field in lower case, e.g. "
                    f"norway:population; the fields are {', '.join(FIELDS)}"), 0.0, False, {"error": True}
        if key not in self.table:
            return f"error: no entry {key!r}; the fields are {', '.join(FIELDS)}", 0.0, False, {"error": True}
        return self.table[key], 0.0, False, {}
