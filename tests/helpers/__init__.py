"""Helpers the unit, integration and reliability tests share (`from helpers.engine
import ...`). A package on the test path rather than conftest modules: several
conftests share that module name, and a helper is imported, not injected."""
