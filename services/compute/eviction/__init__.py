"""Eviction: budgets, policies, block features, rounds and the advisor link."""
