"""The endpoint as a Prefect flow: ``evertrain.flows.deploy.build_endpoint_deployment`` makes it a deployment
beside the campaign's, so the Prefect UI starts, stops and shows the endpoint like any other run."""

from __future__ import annotations

from prefect import flow

from evertrain.config import CampaignConfig
from evertrain.quiet import quiet_libraries
from evertrain.serving.app import serve


@flow(name="endpoint", log_prints=True)
def endpoint_flow(config: CampaignConfig, host: str | None = None, port: int | None = None) -> None:
    """Serve the campaign's champion (OpenAI-compatible chat completions) until the run is cancelled."""
    quiet_libraries()
    serve(config, host=host, port=port)
