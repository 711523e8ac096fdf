"""Serving the champion: an OpenAI-compatible endpoint, its traces in the store, and curation from them.

- :mod:`evertrain.serving.app`: the FastAPI application and the champion it serves (hot-swapped on promotion).
- :mod:`evertrain.serving.redact`: the redaction rule every trace passes before it is stored.
- :mod:`evertrain.serving.traces`: the batched trace writer, cost, and the live pass rate queries.
- :mod:`evertrain.serving.trace_source`: verifiable traces turned into training problems (curation).
- :mod:`evertrain.serving.flow`: the endpoint as a Prefect flow and deployment.
"""
