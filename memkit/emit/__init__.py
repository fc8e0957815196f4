"""Emitters: pure dict builders (deepspeed.py, accelerate.py) and the file writer (bundle.py)."""
