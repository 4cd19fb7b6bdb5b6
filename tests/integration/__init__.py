"""The integration suite. A package, so that its test files import their shared
stack helpers and each other's fixtures relatively (`from .stack_helpers import ...`)
under pytest's importlib mode, which puts no test folder on sys.path."""
