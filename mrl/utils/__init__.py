"""Small shared utilities (process launcher for tests and tools)."""
