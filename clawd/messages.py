"""Reading chat messages as OpenAI's API shapes them: content as a string or a list of parts, tool-call
arguments as JSON text or a mapping. Shared by sessions (comparing conversations), scoring (showing
them to a judge) and the judge client (reading a reply)."""
from __future__ import annotations

import json
from typing import Any


def content_parts(content: Any) -> tuple[str, list[Any]]:
    """A message's text (a string as is; text parts joined; None is "") and its parts that are not text."""
    if content is None:
        return "", []
    if isinstance(content, str):
        return content, []
    if isinstance(content, list):
        texts, others = [], []
        for part in content:
            if isinstance(part, dict) and part.get("type") == "text":
                texts.append(part.get("text") or "")
            elif isinstance(part, str):
                texts.append(part)
            else:
                others.append(part)
        return "".join(texts), others
    return "", [content]


def tool_arguments(args: Any) -> Any:
    """Tool-call arguments as a value: JSON text decoded (clawd's replies carry text, request messages
    may carry a mapping); text that is not JSON stays as the model wrote it (models do emit broken JSON)."""
    if isinstance(args, str):
        try:
            return json.loads(args)
        except ValueError:
            return args
    return args
