"""Lossless speculative decoding: the EAGLE-2 tree (``tree``), the generator (``generator``), the fast
CPU paths for the target and the draft (``fast_target``, ``fast_draft``, ``weight_quant``) and the
continuous batcher gen-data regenerates with (``batch_decode``). May import ``core``, ``config``,
``model`` and ``engines``.
"""
