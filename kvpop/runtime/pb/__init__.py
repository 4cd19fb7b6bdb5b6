"""Generated gRPC stubs; regenerate with `python -m kvpop.protogen`."""
