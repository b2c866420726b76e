"""splitserve tests."""
