"""Schedules whose order comes from outside the registry (``torch-csv:PATH``)."""
