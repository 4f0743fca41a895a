"""Developer tools shared by tests, the demo model and benchmarks (not part of the served package)."""
