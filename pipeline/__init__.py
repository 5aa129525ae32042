"""Prefect orchestration of the DVC DAG (flows, tasks, deployments). Nothing scientific lives here."""
