"""The model: its config, weights, forward pass, tokenizer and sampling."""
