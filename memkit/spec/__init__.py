"""Specs: what the model is (model.py, hf.py) and what it runs on (hardware.py)."""
