"""Active rollouts beside live chat: prompt sets and environments the learner draws from, N answers a prompt
(docs/ARCHITECTURE.md §19)."""
