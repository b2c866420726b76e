"""Security primitives every process shares: the internal secret and the proofs made with it, and the
signing of internal HTTP calls. API keys and rate limits live with the router (router/auth)."""
