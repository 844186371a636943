"""Test-only helpers shared by tests and bench."""
