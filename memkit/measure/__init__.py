"""Memory and throughput measurement used by the runner, `verify`, and the estimator tests."""
