"""Prefect flows: one iteration of the loop, and a campaign of iterations."""

from evertrain.flows.campaign import campaign_flow, iteration_flow

__all__ = ["campaign_flow", "iteration_flow"]
