"""Training-time test: the trainer, the TTT unroll and its losses (``ttt``), batching, checkpoints and the
run report. May import ``publish`` (a finished run exports and inspects its draft) and everything
below it.
"""
