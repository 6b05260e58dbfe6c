"""A tiny random Llama GGUF with a byte-level BPE tokenizer and a chat template."""

import pytest

CHAT = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
        "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def write_tiny_gguf(path, seed=0, tied=True):
    """A 2-layer random Llama GGUF (f32) with a byte-level BPE tokenizer and a chat template."""
    gguf = pytest.importorskip("gguf")
    import numpy as np
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    rng = np.random.default_rng(seed)
    h, inter, n_layers, nh, nkv = 32, 64, 2, 4, 2
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    tokens = specials + list(bytes_to_unicode().values()) + ["Ġt", "he", "Ġthe"]
    v = len(tokens)
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_name("tiny")
    w.add_block_count(n_layers)
    w.add_context_length(256)
    w.add_embedding_length(h)
    w.add_feed_forward_length(inter)
    w.add_head_count(nh)
    w.add_head_count_kv(nkv)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_rope_freq_base(100000.0)
    w.add_rope_dimension_count(h // nh)
    w.add_vocab_size(v)
    w.add_tokenizer_model("gpt2")
    w.add_token_list(tokens)
    w.add_token_types([3] * len(specials) + [1] * (v - len(specials)))
    w.add_token_merges(["Ġ t", "h e", "Ġt he"])
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_unk_token_id(0)
    w.add_pad_token_id(2)
    w.add_chat_template(CHAT)

    def t(*shape):
        return (rng.standard_normal(shape) * 0.1).astype(np.float32)

    w.add_tensor("token_embd.weight", t(v, h))
    w.add_tensor("output_norm.weight", 1 + t(h))
    if not tied:
        w.add_tensor("output.weight", t(v, h))
    hd = h // nh
    for i in range(n_layers):
        for name, shape in [("attn_norm", (h,)), ("ffn_norm", (h,))]:
            w.add_tensor(f"blk.{i}.{name}.weight", 1 + t(*shape))
        for name, shape in [("attn_q", (nh * hd, h)), ("attn_k", (nkv * hd, h)), ("attn_v", (nkv * hd, h)),
                            ("attn_output", (h, nh * hd)), ("ffn_gate", (inter, h)), ("ffn_up", (inter, h)),
                            ("ffn_down", (h, inter))]:
            w.add_tensor(f"blk.{i}.{name}.weight", t(*shape))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path
