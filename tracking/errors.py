"""Errors of the tracking layer that the CLI reports in one line (no MLflow import here, so the
CLI can name them before it loads MLflow)."""


class TrackingStoreError(Exception):
    """A tracking store this MLflow cannot open (e.g. a SQLite store written by another version)."""


class KnowledgeError(Exception):
    """A knowledge-base request that cannot be met: an unknown entry, a state change it does not allow."""
