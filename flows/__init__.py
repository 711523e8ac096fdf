"""Prefect flows: ``campaign.py`` (one iteration, a campaign of iterations) and ``deploy.py`` (schedules)."""
