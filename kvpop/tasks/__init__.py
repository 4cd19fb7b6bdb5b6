"""Seeded reasoning-task generators (evaluation and training data)."""
from kvpop.tasks.instance import Instance
from kvpop.tasks.suite import FAMILIES, TEST_SEEDS, TRAIN_SEEDS, generate, test_set

__all__ = ["Instance", "FAMILIES", "TEST_SEEDS", "TRAIN_SEEDS", "generate", "test_set"]
