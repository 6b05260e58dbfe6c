"""Measuring drafts: ``eval`` with our generator (``evaluate``), replaying its prompts in other engines
(``replay``, ``vllm_eval``, ``llamacpp``). May import every wing below it except ``workflows``.
"""
