"""`kvpop train-model`: a few real optimizer steps, checkpoint, resume, export."""
from __future__ import annotations

import csv
import json

import torch

from kvpop.cli import main


def test_train_resume_and_export(tmp_path):
    out, export = tmp_path / "run", tmp_path / "export"
    tiny = ["--layers", "2", "--hidden", "32", "--heads", "2", "--kv-heads", "1", "--ff", "48",
            "--tokens-per-batch", "600", "--no-compile", "--threads", "1", "--out", str(out)]
    assert main(["train-model", *tiny, "--max-steps", "3"]) == 0
    ck = torch.load(out / "checkpoint.pt", weights_only=False)
    assert ck["state"]["step"] == 3
    first = {k: v.clone() for k, v in ck["model"].items()}
    assert main(["train-model", *tiny, "--max-steps", "5", "--resume", "--export", str(export)]) == 0
    ck = torch.load(out / "checkpoint.pt", weights_only=False)
    assert ck["state"]["step"] == 5
    assert any(not torch.equal(first[k], v) for k, v in ck["model"].items())   # it kept training
    rows = list(csv.DictReader((out / "training_log.csv").open()))
    assert [int(r["step"]) for r in rows] == [0]           # one row per 10 steps, not repeated on resume
    assert (out / "training_curve.png").stat().st_size > 1000
    from services.compute.model.loader import load_model
    for d in (out / "model", export):
        model = load_model(d)
        assert json.loads((d / "config.json").read_text())["num_hidden_layers"] == 2
        assert (d / "tokenizer.json").is_file()
        torch.testing.assert_close(model.state_dict()["lm_head.weight"], ck["model"]["lm_head.weight"])
