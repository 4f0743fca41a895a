"""Compute kernels: pure-torch oracles (reference.py) and fast backends (int4.py, ...)."""
