"""Training data: conversation sources, chat-template loss masks, regeneration by the target, the feature
store and its manifest, ``gen-data`` and ``merge-data``. May import every wing below it (``core``,
``config``, ``model``, ``engines``, ``decode``).
"""
