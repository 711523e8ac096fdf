"""Inference: every way the project samples from a policy, behind one interface with declared capabilities.

- :mod:`~evertrain.inference.base`: the :class:`Sampler` interface, its :class:`Capabilities`, what it returns;
- :mod:`~evertrain.inference.local`: the in-house sampler (``generation.backend = "hf"``);
- :mod:`~evertrain.inference.vllm_sampler` and :mod:`~evertrain.inference.vllm_engine`: a vLLM engine process;
- :mod:`~evertrain.inference.vllm_server`: vLLM's own OpenAI server, for the endpoint;
- :mod:`~evertrain.inference.backends`: the backends, what each refuses and warns of, how each opens a checkpoint;
- :mod:`~evertrain.inference.episodes`: single- and multi-turn (tool) episodes over any sampler;
- :mod:`~evertrain.inference.ray_workers`: sampling on Ray rollout workers;
- :mod:`~evertrain.inference.campaign`: :class:`Inference`, the one object a campaign's context holds.

Inference imports neither the learner (:mod:`evertrain.models`' loss, train step and update) nor the orchestration
(flows, stages, the campaign context, the store): ``tests/test_layering.py`` checks it.
"""
