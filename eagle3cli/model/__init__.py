"""What a draft and a target are: the EAGLE-3 draft module (``draft``), loading and capturing the
target (``target``, ``sharded_target``), which target layers feed the draft (``layers``), the draft
vocabulary and its d2t/t2d maps (``vocab``) and warm starts from the target's own weights
(``warm_start``). May import ``core`` and ``config``.
"""
