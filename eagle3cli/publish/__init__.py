"""What leaves the machine: the draft's on-disk format and the engines' config keys (``export``), other
tools' formats (``formats``), the checks ``inspect`` runs (``inspector``), GGUF for llama.cpp
(``gguf_export``), the model card and ``push``. May import ``data`` and everything below it.
"""
