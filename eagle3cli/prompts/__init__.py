"""Prompt sets shipped with the package (see README.md here)."""
