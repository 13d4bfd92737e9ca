"""The trainer process's own code (torch; threads allowed): the handler and what it imports. The daemon never
imports it (`clawd/trainer/`'s other modules are the daemon's side: the link, the wire, the spawn target)."""
