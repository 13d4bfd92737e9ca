"""Privacy: PII detection, private files, retention, consent, per-person export and deletion."""
