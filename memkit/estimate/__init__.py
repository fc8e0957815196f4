"""Estimators: memory.py (per-component, per-phase peak), activations.py, throughput.py."""
