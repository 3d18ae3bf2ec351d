"""Kept for compatibility: :func:`export_amax` lives in :mod:`quantcli.qdq` (``quantcli.nn`` calls it, and
``quantcli.nn`` sits below the exporters); re-exported here."""

from quantcli.qdq import export_amax

__all__ = ["export_amax"]
