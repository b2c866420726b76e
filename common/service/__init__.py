"""What both engine services (prefill, decode) are built on: the service base (engine thread, Redis
registration, /health, /metrics, drain) and its metric collectors. Above the connectors and the engine."""
