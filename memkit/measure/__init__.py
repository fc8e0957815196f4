"""Memory and throughput measurement used by the runner and `verify` (the live-tensor tracker, CUDA counters)."""
