"""Serving engines as processes we drive: which draft options each engine reads (``engine_support``) and
the vLLM workers that capture hidden states or decode in vLLM's own Python (``vllm_engine``,
``vllm_worker``, ``vllm_capture``, ``vllm_decode``). The workers run inside vLLM's virtual
environment, so this wing imports neither torch at module level nor anything above ``core``.
"""
