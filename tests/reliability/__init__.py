"""The reliability suite. A package, so its conftest is `reliability.conftest`
and does not shadow the `conftest` module other test directories import."""
