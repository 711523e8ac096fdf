"""openenv-count: an OpenEnv (openenv-core 0.3.0) environment written only against that package's public API.

An episode keeps a running total: the first observation gives a start and an operation, each step's action is
the new total, and each right answer brings the next operation, until ``STEPS`` answers were right (reward 1,
done) or one was wrong (reward 0, done). Serve it with ``uvicorn openenv_count.server:app``; a session (one
WebSocket connection) is one episode, and ``reset(seed=...)`` makes the same episode for the same seed.
"""
