"""Faults injected by real signals into real processes while streams run."""
