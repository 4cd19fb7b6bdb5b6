"""Models: `kvpop fetch-model` (download and GGUF conversion) and the embedded default model."""
