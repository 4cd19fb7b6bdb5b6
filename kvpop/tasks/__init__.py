"""Seeded reasoning-task generators (evaluation and training data): the mix,
its seeds and the standard test set in kvpop.tasks.suite."""
