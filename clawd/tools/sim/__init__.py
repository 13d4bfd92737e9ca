"""Simulated users for showing that clawd learns.

personas.py  who the users are: a verifiable preference each, thanks or a correction (pure)
users.py     users that talk to a running clawd through the official `openai` client
launch.py    a clawd process for the demo and the learning bench, and its status
demo.py      `make demo`: live progress, then a PNG and a JSON summary

Nothing here runs inside the daemon: these are its clients.
"""
