"""Calibration harnesses: memkit's estimates scored against published GPU runs
(published_memory.py: peak memory; published_throughput.py: step time and plan ranking).
Used by benchmarks/ and the tests; the top layer below cli/ (memkit/ARCHITECTURE.md)."""
