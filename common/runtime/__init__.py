"""What a service process shares: the app factory, metrics, telemetry."""
