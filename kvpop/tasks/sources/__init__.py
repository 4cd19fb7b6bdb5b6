"""Haystack text sources for the real-text suite; the catalog is kvpop.tasks.sources.catalog."""
