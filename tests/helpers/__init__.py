"""What several test modules share: tiny targets (tiny.py, families.py), fake engines run as
scripts (fake_llama_server.py, fake_vllm_worker.py) and builders of drafts, stores and prompts.
Test modules import from here, never from one another (tests/repo/test_layout.py)."""
