"""What a continued network records about the networks it continues."""
from kvpop.training.train_estimator import lineage


def test_a_continuation_records_every_source_and_length_its_chain_was_traced_on():
    first = {"suite": "real", "lengths": [1024, 2048]}                    # before runs recorded sources
    second = {"suite": "real", "sources": ["docstrings", "code"], "lengths": [2048, 4096],
              "init": lineage(first)}
    assert lineage(first) == {"sources": ["generator"], "lengths": [1024, 2048]}
    assert lineage(second) == {"sources": ["docstrings", "code", "generator"], "lengths": [1024, 4096]}
    # The default model's task suite has no text sources.
    assert lineage({"suite": "tasks", "lengths": [448, 1280]}) == {"lengths": [448, 1280]}
    assert lineage({}) == {}
