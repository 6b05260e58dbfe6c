"""The flags as dataclasses: every command's options (``options``) and the training config with its
recipes (``train_config``). One home per flag, so the CLI, the recipes and library callers agree.
May import ``core`` only.
"""
