"""The calculator environment: arithmetic and unit conversions a small model gets wrong by heart and right
with its tools (docs/ARCHITECTURE.md §19).

`Calculator.reset(seed)` draws a problem from the seed (the same seed, the same problem: a group's N episodes
answer one question); the model may call `calculate` (an arithmetic expression) and `convert` (a value
between units) as often as the daemon's bounds allow, and ends the episode with a reply: reward 1 when its
final number is the answer (a conversion: within 0.1 %), else 0. A bad expression, an unknown unit or an unknown tool is an
observation that says so, never an exception.
"""
from __future__ import annotations

import ast
import math
import operator
import random

from clawd.rollouts.tasks import final_number

TOLERANCE = 1e-3  # relative, for conversions: an answer rounded to a few digits still counts (integers: exact)
MAX_EXPONENT = 64
MAX_MAGNITUDE = 1e30
_BINARY = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
           ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod, ast.Pow: operator.pow}
_UNARY = {ast.USub: operator.neg, ast.UAdd: operator.pos}
# Each unit to its dimension's base (metres, kilograms); temperatures convert by formula.
UNITS = {"m": ("length", 1.0), "km": ("length", 1000.0), "cm": ("length", 0.01), "mi": ("length", 1609.344),
         "ft": ("length", 0.3048), "in": ("length", 0.0254), "kg": ("mass", 1.0), "g": ("mass", 0.001),
         "lb": ("mass", 0.45359237), "oz": ("mass", 0.028349523125)}
TEMPERATURES = ("C", "F", "K")

CALCULATOR_TOOLS = [
    {"type": "function", "function": {
        "name": "calculate", "description": "Evaluate an arithmetic expression: + - * / // % ** and parentheses.",
        "parameters": {"type": "object", "properties": {"expression": {"type": "string"}},
                       "required": ["expression"]}}},
    {"type": "function", "function": {
        "name": "convert", "description": "Convert a value between units: m km cm mi ft in, kg g lb oz, C F K.",
        "parameters": {"type": "object", "properties": {
            "value": {"type": "number"}, "from_unit": {"type": "string"}, "to_unit": {"type": "string"}},
            "required": ["value", "from_unit", "to_unit"]}}},
]


def evaluate(expression: str) -> float:
    """An arithmetic expression's value (numbers, + - * / // % **, parentheses); ValueError otherwise."""
    if not isinstance(expression, str) or len(expression) > 200:
        raise ValueError("the expression must be a string of at most 200 characters")
    try:
        tree = ast.parse(expression.replace("×", "*").replace("÷", "/").replace("^", "**"), mode="eval")
    except SyntaxError:
        raise ValueError(f"{expression!r} is not an arithmetic expression") from None

    def value(node: ast.AST) -> float:
        if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)) and not isinstance(node.value, bool):
            return node.value
        if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
            return _UNARY[type(node.op)](value(node.operand))
        if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
            left, right = value(node.left), value(node.right)
            if isinstance(node.op, ast.Pow) and abs(right) > MAX_EXPONENT:
                raise ValueError(f"exponents above {MAX_EXPONENT} are refused")
            try:
                out = _BINARY[type(node.op)](left, right)
            except ZeroDivisionError:
                raise ValueError("division by zero") from None
            if isinstance(out, complex) or not math.isfinite(out) or abs(out) > MAX_MAGNITUDE:
                raise ValueError("the result is out of range")
            return out
        raise ValueError(f"{ast.unparse(node)!r} is not allowed: numbers and + - * / // % ** only")

    return float(value(tree.body))


def convert(value: float, from_unit: str, to_unit: str) -> float:
    """`value` in `from_unit` as `to_unit`; ValueError for unknown or mismatched units."""
    if from_unit in TEMPERATURES and to_unit in TEMPERATURES:
        kelvin = {"C": value + 273.15, "F": (value - 32) * 5 / 9 + 273.15, "K": value}[from_unit]
        return {"C": kelvin - 273.15, "F": (kelvin - 273.15) * 9 / 5 + 32, "K": kelvin}[to_unit]
    if from_unit not in UNITS or to_unit not in UNITS:
        unknown = from_unit if from_unit not in UNITS and from_unit not in TEMPERATURES else to_unit
        raise ValueError(f"unknown unit {unknown!r}; known: {', '.join([*UNITS, *TEMPERATURES])}")
    (kind_a, scale_a), (kind_b, scale_b) = UNITS[from_unit], UNITS[to_unit]
    if kind_a != kind_b:
        raise ValueError(f"cannot convert {kind_a} ({from_unit}) to {kind_b} ({to_unit})")
    return value * scale_a / scale_b


def question(seed: int) -> tuple[str, float, float]:
    """(the task's text, its answer, the relative tolerance an answer has), drawn from `seed`."""
    rng = random.Random(seed)
    kind = rng.choice(("product", "sum_product", "convert", "temperature"))
    if kind == "product":
        a, b = rng.randint(120, 999), rng.randint(13, 99)
        return f"What is {a} × {b}?", float(a * b), 0.0
    if kind == "sum_product":
        a, b, c = rng.randint(100, 999), rng.randint(11, 99), rng.randint(1000, 9999)
        return f"What is {a} × {b} + {c}?", float(a * b + c), 0.0
    if kind == "convert":
        a, (u, v) = round(rng.uniform(2, 500), 1), rng.choice([("mi", "km"), ("km", "mi"), ("lb", "kg"),
                                                               ("kg", "lb"), ("ft", "m"), ("in", "cm")])
        return f"How many {v} is {a} {u}?", convert(a, u, v), TOLERANCE
    a, (u, v) = rng.randint(-40, 120), rng.choice([("F", "C"), ("C", "F")])
    return f"What is {a} degrees {u} in degrees {v}?", convert(float(a), u, v), TOLERANCE


class Calculator:
    tools = CALCULATOR_TOOLS

    def reset(self, seed: int) -> str:
        self.text, self.answer, self.tolerance = question(seed)
        return (f"{self.text} Use the tools to work it out, then reply with the final number.")

    def step(self, action: dict) -> tuple[str, float, bool, dict]:
        if "answer" in action:
            got = final_number(action["answer"])
            right = got is not None and abs(got - self.answer) <= max(1e-6, self.tolerance * abs(self.answer))
            return ("Correct." if right else "Not correct."), float(right), True, {"answer": self.answer, "got": got}
        name, args = action.get("tool"), action.get("arguments", {})
        try:
            if name == "calculate":
                return _shown(evaluate(args.get("expression"))), 0.0, False, {}
            if name == "convert":
                value = args.get("value")
                if isinstance(value, str):
                    value = evaluate(value)
                if not isinstance(value, (int, float)) or isinstance(value, bool):
                    raise ValueError("value must be a number")
                return _shown(convert(float(value), args.get("from_unit"), args.get("to_unit"))), 0.0, False, {}
        except (ValueError, TypeError) as exc:
            return f"error: {exc}", 0.0, False, {"error": True}
        return f"error: there is no tool named {name!r}; the tools are calculate and convert", 0.0, False, \
            {"error": True}


def _shown(x: float) -> str:
    return str(int(x)) if x == int(x) and abs(x) < 1e15 else f"{x:.6g}"
