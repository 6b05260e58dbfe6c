"""export-gguf for a DFlash draft: through llama.cpp's own converter only (it takes the target's
tokenizer and the MASK id), and what the converter writes is what the draft's config.json says."""

from __future__ import annotations

import os

import pytest
import torch
from transformers import AutoConfig

from eagle3cli.model.dflash import DFlashConfig, DFlashDraft
from eagle3cli.publish.export import save_draft
from eagle3cli.publish.gguf_export import GGUFExportError, export_gguf, serve_line


def dflash_dir(target_dir, out, block=6):
    cfg = AutoConfig.from_pretrained(target_dir)
    n = cfg.num_hidden_layers
    d = DFlashDraft(DFlashConfig.from_target(cfg, (1, n - 1), block_size=block, mask_token_id=cfg.vocab_size - 1,
                                             num_hidden_layers=1))
    d.init_weights(seed=0)
    save_draft(d, out, {"layer_ids": [1, n - 1], "block_size": block}, dtype=torch.float32)
    return out


def test_without_the_converter_a_dflash_draft_is_one_line(smol_tiny_dir, tmp_path, monkeypatch):
    monkeypatch.delenv("EAGLE3_LLAMA_CPP", raising=False)
    draft = dflash_dir(smol_tiny_dir, tmp_path / "d")
    with pytest.raises(GGUFExportError, match="a DFlash draft is converted by llama.cpp's own convert_hf_to_gguf.py"):
        export_gguf(draft, tmp_path / "g", target_gguf=tmp_path / "t.gguf")
    assert serve_line(draft, "T.gguf", "D.gguf") == ("llama-server -m T.gguf -md D.gguf --spec-type draft-dflash "
                                                     "--spec-draft-n-max 5")


@pytest.mark.skipif(not os.environ.get("EAGLE3_LLAMA_CPP"), reason="needs llama.cpp sources ($EAGLE3_LLAMA_CPP)")
def test_llamacpps_converter_reads_the_block_layers_and_mask(smol_tiny_dir, tmp_path):
    import sys

    from eagle3cli.publish.gguf_export import find_converter

    conv = find_converter()
    if conv is None:
        pytest.skip("no convert_hf_to_gguf.py under $EAGLE3_LLAMA_CPP")
    sys.path.insert(0, str(conv.parent / "gguf-py"))
    import gguf

    draft = dflash_dir(smol_tiny_dir, tmp_path / "d")
    files, _ = export_gguf(draft, tmp_path / "g", "f32", target_dir=smol_tiny_dir)
    r = gguf.GGUFReader(str(files["draft"]))

    def val(key):
        f = r.fields[key]
        return [x.item() for i in f.data for x in f.parts[i]]

    n = AutoConfig.from_pretrained(smol_tiny_dir).num_hidden_layers
    assert val("dflash.block_size") == [6] and val("dflash.target_layers") == [1, n - 1]  # input count again
    assert val("tokenizer.ggml.mask_token_id") == [AutoConfig.from_pretrained(smol_tiny_dir).vocab_size - 1]
    names = {t.name for t in r.tensors}
    assert {"fc.weight", "enc.output_norm.weight", "output_norm.weight", "blk.0.attn_q_norm.weight"} <= names
    assert not any(t.startswith(("token_embd", "output.")) for t in names)  # the target's, shared at run time
