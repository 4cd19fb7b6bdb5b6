"""Value-estimation networks shipped for the models `kvpop fetch-model` knows (placed beside their weights)."""
