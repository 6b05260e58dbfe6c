"""eagle3: train, evaluate and ship EAGLE-3 speculative-decoding draft heads.

The package is a library first; ``eagle3cli.cli`` is a thin typer layer over it.
"""

__version__ = "0.3.0"
