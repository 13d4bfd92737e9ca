"""Environments that ship with clawd, run in the deployment worker like a deployment's own
(clawd.rollouts.episodes): `calculator` (arithmetic and unit conversions through tools) and `lookup` (a fact
table whose keys must be written its way: recovering from an error is the skill)."""
