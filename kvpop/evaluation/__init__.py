"""Eviction-quality evaluation: every policy at every compression on the same prompts."""
