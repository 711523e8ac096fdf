"""openenv-count: an OpenEnv (openenv-core 0.3.0) environment written only against that package's public API.

An episode keeps a running total: the first observation gives a start and an operation, each step's action is
the new total, and each right answer brings the next operation, until ``steps`` answers were right (reward 1,
done) or one was wrong (reward 0, done); two steps unless ``reset(steps=...)`` asks otherwise. Serve it with
``uvicorn openenv_count.server:app``; a session (one WebSocket connection) is one episode, and
``reset(seed=...)`` makes the same episode for the same seed.
"""

# the package's own curriculum, easiest first: each level's reset() arguments (right answers an episode needs);
# a literal, so a trainer can read it without importing the package (evertrain's OpenEnv adapter does)
CURRICULUM = [{"steps": 1}, {"steps": 2}, {"steps": 3}]
