"""What the services stand on: configuration, security, metrics, telemetry, Redis (sessions,
replica registry, prewarm counts), the gRPC server, the health check, the model cache and the
generated stubs (pb/). Nothing here imports a tool (tests/unit/docs/test_layers.py)."""
