"""POST /v1/feedback: a user's rating of one of clawd's replies (docs/ARCHITECTURE.md §5, *Explicit feedback*).

The body: `{"id": "chatcmpl-…", "rating": 1 | -1, "text": "…"?, "user": "…"?}` (`user` names the principal only
where the operator trusts it, as on chat). The rating goes to the scorer's registry (clawd.scoring.feedback),
which says what becomes of it; every rating it knows is recorded (state/records/feedback-*.jsonl, as privacy
lets it: exported and forgotten with the principal's turns). The answer:
`{"object": "feedback", "id", "rating", "status": "pending" | "late" | "not_trainable"}`; a reply that is not
the principal's, or not remembered, is a 404 `reply_not_found`.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

from clawd.records import RecordWriter
from clawd.scoring.feedback import Rating, Ratings, UnknownReply
from clawd.serving.errors import ApiError, bad_request
from clawd.serving.request import json_object

REQUEST_FIELDS = ("id", "rating", "text", "user")
MAX_ID_CHARS = 128


@dataclass(frozen=True)
class FeedbackRequest:
    reply_id: str
    rating: int
    text: str | None
    user: str | None


def parse_feedback(body: bytes, max_text_chars: int) -> FeedbackRequest:
    """The request, or a 400 naming the field at fault. Unknown fields are refused: a misspelt "rating" must not
    pass as a request without one."""
    data = json_object(body)
    if unknown := sorted(set(data) - set(REQUEST_FIELDS)):
        raise bad_request(f"Unknown field {unknown[0]!r}; a feedback request has {', '.join(REQUEST_FIELDS)}",
                          unknown[0], "unknown_parameter")
    reply_id = data.get("id")
    if reply_id is None:
        raise bad_request("'id' is a required property: the reply's id, as in the chat completion", "id",
                          "missing_required_parameter")
    if not isinstance(reply_id, str) or not reply_id.startswith("chatcmpl-") or len(reply_id) > MAX_ID_CHARS:
        raise bad_request("'id' must be a chat completion's id (\"chatcmpl-...\")", "id", "invalid_value")
    rating = data.get("rating")
    if rating is None:
        raise bad_request("'rating' is a required property: 1 (good) or -1 (bad)", "rating",
                          "missing_required_parameter")
    if isinstance(rating, bool) or rating not in (1, -1):  # 1.0 is 1; True is not a rating
        raise bad_request("'rating' must be 1 (good) or -1 (bad)", "rating", "invalid_value")
    text = data.get("text")
    if text is not None and not isinstance(text, str):
        raise bad_request("'text' must be a string", "text", "invalid_type")
    if text is not None and len(text) > max_text_chars:
        raise bad_request(f"'text' holds {len(text)} characters, more than the limit of {max_text_chars}", "text",
                          "text_too_long")
    user = data.get("user")
    if user is not None and not isinstance(user, str):
        raise bad_request("'user' must be a string", "user", "invalid_type")
    return FeedbackRequest(reply_id, int(rating), text.strip() or None if text is not None else None, user)


class FeedbackDesk:
    """Where ratings arrive: the registry, then the record. `record_view`: what privacy lets a feedback record
    keep (None: no record, a key with record = false)."""

    def __init__(self, ratings: Ratings, records: RecordWriter | None,
                 record_view: Callable[[dict[str, Any]], dict[str, Any] | None] = lambda r: r):
        self.ratings = ratings
        self.records = records
        self.record_view = record_view

    def rate(self, principal: str, req: FeedbackRequest, now: float) -> dict[str, Any]:
        rating = Rating(principal, req.reply_id, req.rating, req.text, now)
        try:
            status, where = self.ratings.rate(rating)
        except UnknownReply:
            raise ApiError(404, f"No reply {req.reply_id!r} was served to this key that clawd still remembers "
                           f"(side turns are never kept, and only the newest {self.ratings.max_replies} replies are)",
                           param="id", code="reply_not_found") from None
        if self.records is not None:
            record = {"principal": principal, "reply_id": req.reply_id, **where, "rating": req.rating,
                      "text": req.text, "status": status, "received": now}
            if (record := self.record_view(record)) is not None:
                self.records.write(record, now)
        return {"object": "feedback", "id": req.reply_id, "rating": req.rating, "status": status}
