import os

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")

# Tiny models gain nothing from threads; on a shared 2-core box a second thread costs ~70x.
torch.set_num_threads(1)

from tests.helpers.tiny import SMOLLM2_TOKENIZER, save_tiny  # noqa: E402


@pytest.fixture(scope="session")
def smol_tiny_dir(tmp_path_factory):
    """A tiny random Llama with SmolLM2's real tokenizer and chat template (vocab 49152)."""
    return save_tiny(tmp_path_factory.mktemp("smol_tiny"), "llama", tokenizer_dir=SMOLLM2_TOKENIZER,
                     hidden_size=64, intermediate_size=128)
