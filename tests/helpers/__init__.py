"""Test-only helpers (never shipped): LMCache's own parsers and a raw MP client."""
