"""Loss masks from chat templates: the masked tokens are exactly what the assistant wrote
plus its end-of-turn token, for every template family (real tokenizers, realistic templates)."""

from pathlib import Path

import pytest
from transformers import AutoTokenizer

from eagle3cli.data.chat_mask import (
    MaskError,
    NoChatTemplate,
    chat_template,
    end_of_turn_ids,
    has_generation_markers,
    highlight,
    masked_segments,
    tokenize_conversation,
)
from tests.helpers.tiny import QWEN_TOKENIZER, SMOLLM2_TOKENIZER

TEMPLATES = Path(__file__).parents[1] / "fixtures" / "chat_templates"

CONV = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "What is 2+2? Answer like an assistant."},
    {"role": "assistant", "content": "It is 4 — easy. 🎉"},
    {"role": "user", "content": "And 3+3?"},
    {"role": "assistant", "content": "assistant\n\n6, of course.\n- done"},
]
ANSWERS = [m["content"] for m in CONV if m["role"] == "assistant"]

# family -> (tokenizer dir, template file or None for the tokenizer's own, tokens the real
# tokenizer of that family has as special tokens, bos, eos, end-of-turn, drop system?)
FAMILIES = {
    "chatml-smollm2": (SMOLLM2_TOKENIZER, None, [], None, None, "<|im_end|>"),
    "chatml-qwen2.5": (QWEN_TOKENIZER, None, [], None, None, "<|im_end|>"),
    "llama3": (SMOLLM2_TOKENIZER, "llama3.jinja", ["<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"],
               "<|begin_of_text|>", "<|eot_id|>", "<|eot_id|>"),
    "gemma3": (SMOLLM2_TOKENIZER, "gemma3.jinja", ["<start_of_turn>", "<end_of_turn>"], "<bos>", "<eos>",
               "<end_of_turn>"),
    "phi3": (SMOLLM2_TOKENIZER, "phi3.jinja", ["<|system|>", "<|user|>", "<|assistant|>", "<|end|>"], None,
             "<|endoftext|>", "<|end|>"),
}


def family_tokenizer(tok_dir, template=None, specials=(), bos=None, eos=None):
    tok = AutoTokenizer.from_pretrained(tok_dir)
    add = {}
    if specials:
        add["additional_special_tokens"] = list(specials)
    if bos:
        add["bos_token"] = bos
    if eos:
        add["eos_token"] = eos
    if add:
        tok.add_special_tokens(add)
    if template:
        tok.chat_template = (TEMPLATES / template).read_text()
    return tok


def segments_text(tok, messages, **kw):
    r = tokenize_conversation(tok, messages, **kw)
    return [tok.decode(s) for s in masked_segments(r.input_ids, r.loss_mask)], r


@pytest.mark.parametrize("family", list(FAMILIES))
def test_masked_tokens_are_the_answers_plus_end_of_turn(family):
    tok_dir, tpl, specials, bos, eos, eot = FAMILIES[family]
    tok = family_tokenizer(tok_dir, tpl, specials, bos, eos)
    segs, r = segments_text(tok, CONV)
    assert segs == [a + eot for a in ANSWERS]
    assert r.end_ids == {tok.convert_tokens_to_ids(eot)}
    # Every token is either learned or context: the unmasked part still holds the prompts.
    unmasked = tok.decode([i for i, m in zip(r.input_ids, r.loss_mask) if not m])
    assert "What is 2+2?" in unmasked and "And 3+3?" in unmasked and "It is 4" not in unmasked
    # The ids are exactly what apply_chat_template produces (masks align with real inputs).
    assert r.input_ids == list(tok.apply_chat_template(CONV, tokenize=True, return_dict=True)["input_ids"])


def test_mistral_inst_template():
    tok = family_tokenizer(SMOLLM2_TOKENIZER, "mistral.jinja", ["[INST]", "[/INST]"], "<s>", "</s>")
    segs, r = segments_text(tok, CONV)
    # The template writes ' ' + content: GPT-2 style BPE folds that space into the first token.
    assert segs == [" " + a + "</s>" for a in ANSWERS]
    assert r.end_ids == {tok.convert_tokens_to_ids("</s>")}
    assert end_of_turn_ids(tok) == {tok.convert_tokens_to_ids("</s>")}


def test_trimming_templates_mask_the_trimmed_content():
    tok = family_tokenizer(SMOLLM2_TOKENIZER, "llama3.jinja", FAMILIES["llama3"][2], "<|begin_of_text|>", "<|eot_id|>")
    conv = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "  spaced out \n"}]
    segs, _ = segments_text(tok, conv)
    assert segs == ["spaced out<|eot_id|>"]


def test_phi3_trailing_eos_is_not_learned():
    """Phi-3 appends EOS after the whole conversation: the model never writes it after <|end|>."""
    tok = family_tokenizer(SMOLLM2_TOKENIZER, "phi3.jinja", FAMILIES["phi3"][2], None, "<|endoftext|>")
    r = tokenize_conversation(tok, CONV)
    assert tok.convert_ids_to_tokens(r.input_ids[-1]) == "<|endoftext|>"
    assert r.loss_mask[-1] is False
    assert tok.decode(r.input_ids[-3:]) == "<|end|>\n<|endoftext|>"


QWEN3_CONV = [
    {"role": "user", "content": "What is 2+2?"},
    {"role": "assistant", "content": "<think>\nTwo and two.\n</think>\n\nIt is 4."},
    {"role": "user", "content": "And 3+3?"},
    {"role": "assistant", "content": "<think>\n3+3 is 6, the answer is 6\n</think>\n\n6"},
]


@pytest.fixture(scope="module")
def qwen3_tok():
    tok = family_tokenizer(QWEN_TOKENIZER, "qwen3.jinja")
    tok.add_tokens(["<think>", "</think>"])  # added, not special, as in Qwen3's tokenizer
    return tok


def test_qwen3_think_blocks(qwen3_tok):
    segs, _ = segments_text(qwen3_tok, QWEN3_CONV)
    # Earlier turns lose their reasoning in the template; the last keeps it. The short answer
    # "6" also appears inside the reasoning: the mask must still end at the real answer.
    assert segs == ["It is 4.<|im_end|>", "<think>\n3+3 is 6, the answer is 6\n</think>\n\n6<|im_end|>"]


def test_qwen3_answer_without_think_gets_the_templates_empty_block(qwen3_tok):
    conv = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello!"}]
    segs, _ = segments_text(qwen3_tok, conv)
    assert segs == ["<think>\n\n</think>\n\nHello!<|im_end|>"]


def test_generation_markers_route():
    tok = family_tokenizer(SMOLLM2_TOKENIZER, "chatml_generation.jinja")
    assert has_generation_markers(chat_template(tok))
    segs, r = segments_text(tok, CONV)
    assert segs == [a + "<|im_end|>" for a in ANSWERS]
    # Same tokens and mask as the turn-by-turn route on the same template without markers.
    plain = family_tokenizer(SMOLLM2_TOKENIZER)
    plain.chat_template = chat_template(tok).replace("{% generation %}", "").replace("{% endgeneration %}", "")
    r2 = tokenize_conversation(plain, CONV)
    assert (r.input_ids, r.loss_mask) == (r2.input_ids, r2.loss_mask)


def test_no_chat_template_is_a_one_line_error():
    tok = family_tokenizer(SMOLLM2_TOKENIZER)
    tok.chat_template = None
    with pytest.raises(NoChatTemplate, match=r"has no chat template: pass --chat-template FILE") as e:
        tokenize_conversation(tok, CONV)
    assert "\n" not in str(e.value)


def test_template_refusal_is_a_mask_error():
    tok = family_tokenizer(SMOLLM2_TOKENIZER, "gemma3.jinja", FAMILIES["gemma3"][2], "<bos>", "<eos>")
    bad = [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}, {"role": "assistant", "content": "c"}]
    with pytest.raises(MaskError, match="roles must alternate"):
        tokenize_conversation(tok, bad)


def test_end_of_turn_ids_from_template():
    tok = family_tokenizer(*[FAMILIES["gemma3"][i] for i in (0, 1, 2, 3, 4)])
    assert end_of_turn_ids(tok) == {tok.convert_tokens_to_ids("<end_of_turn>"), tok.convert_tokens_to_ids("<eos>")}
    smol = family_tokenizer(SMOLLM2_TOKENIZER)
    assert end_of_turn_ids(smol) == {smol.convert_tokens_to_ids("<|im_end|>")}


def test_highlight_marks_exactly_the_learned_text():
    tok = family_tokenizer(SMOLLM2_TOKENIZER)
    r = tokenize_conversation(tok, CONV)
    text = highlight(tok, r.input_ids, r.loss_mask)
    learned = "".join(text.plain[s.start:s.end] for s in text.spans if "green" in str(s.style))
    assert learned == "".join(a + "<|im_end|>" for a in ANSWERS)
    assert text.plain == tok.decode(r.input_ids)
