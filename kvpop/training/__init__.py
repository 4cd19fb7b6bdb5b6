"""Training of the embedded default model on the task mix."""
