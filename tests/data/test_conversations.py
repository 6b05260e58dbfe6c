"""Conversations of 2026 targets: tool calls and results, reasoning (keep / drop thinking), and
last-turn-only learning, each with a real chat template and an exact loss mask."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from transformers import AutoTokenizer

from eagle3cli.data.chat_mask import exact_answer_labels, tokenize_conversation
from eagle3cli.data.endpoint import Endpoint, regenerate_endpoint
from eagle3cli.data.gen_errors import GenDataError
from eagle3cli.data.regenerate import GenSettings, prompt_turns
from eagle3cli.data.samples import build_sample, conversation_samples, reasoning_kwargs
from eagle3cli.data.sources import Conversation, load_conversations
from tests.helpers.tiny import QWEN_TOKENIZER, SMOLLM2_TOKENIZER

TEMPLATES = Path(__file__).parents[1] / "fixtures" / "chat_templates"
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather of a city",
                                           "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                          "required": ["city"]}}}]
CALL = {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}
TOOL_CONV = [
    {"role": "user", "content": "Weather in Paris?"},
    {"role": "assistant", "content": "", "tool_calls": [CALL]},
    {"role": "tool", "content": '{"temp": 21}', "name": "get_weather"},
    {"role": "assistant", "content": "It is 21 degrees in Paris."},
    {"role": "user", "content": "Thanks!"},
    {"role": "assistant", "content": "You are welcome."},
]


@pytest.fixture(scope="module")
def qwen():
    return AutoTokenizer.from_pretrained(QWEN_TOKENIZER)  # its own template: Qwen2.5's, with tools


@pytest.fixture(scope="module")
def qwen3():
    tok = AutoTokenizer.from_pretrained(QWEN_TOKENIZER)
    tok.chat_template = (TEMPLATES / "qwen3_tools_thinking.jinja").read_text()
    return tok


def runs(mask) -> list[tuple[int, int]]:
    out, start = [], None
    for i, m in enumerate(list(mask) + [False]):
        if m and start is None:
            start = i
        elif not m and start is not None:
            out.append((start, i))
            start = None
    return out


def expected_runs(tok, ids, learned: list[str]) -> list[tuple[int, int]]:
    """Token ranges of the ``learned`` strings found in order in the decoded conversation,
    located through the tokenizer's own offsets (independently of chat_mask's route)."""
    text = tok.decode(ids)
    enc = tok(text, add_special_tokens=False, return_offsets_mapping=True)
    assert enc["input_ids"] == list(ids)
    offsets, out, pos = enc["offset_mapping"], [], 0
    for piece in learned:
        c0 = text.index(piece, pos)
        c1 = pos = c0 + len(piece)
        s = next(i for i, (a, _) in enumerate(offsets) if a >= c0)
        e = next((i for i, (a, _) in enumerate(offsets) if a >= c1), len(offsets))
        out.append((s, e))
    return out


def assert_learned(tok, ids, mask, learned: list[str]):
    got = runs(mask)
    assert [tok.decode(ids[s:e]) for s, e in got] == learned
    assert got == expected_runs(tok, ids, learned)


# ------------------------------------------------------------------ tool calls


def test_tool_calls_learn_only_the_assistants_own_tokens(qwen):
    t = tokenize_conversation(qwen, TOOL_CONV, tools=TOOLS)
    text = qwen.decode(t.input_ids)
    # the schemas reached the template
    assert '<tools>\n{"type": "function", "function": {"name": "get_weather"' in text
    assert "<tool_response>\n{\"temp\": 21}\n</tool_response>" in text
    assert_learned(qwen, t.input_ids, t.loss_mask, [
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call><|im_end|>',
        "It is 21 degrees in Paris.<|im_end|>", "You are welcome.<|im_end|>"])


def test_tool_calls_with_a_reasoning_template_too(qwen3):
    conv = TOOL_CONV[:4]
    t = tokenize_conversation(qwen3, conv, tools=TOOLS, enable_thinking=True)
    assert_learned(qwen3, t.input_ids, t.loss_mask, [
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call><|im_end|>',
        "<think>\n\n</think>\n\nIt is 21 degrees in Paris.<|im_end|>"])


def test_sources_keep_tools_calls_results_and_reasoning(tmp_path):
    row = {"tools": json.dumps(TOOLS), "messages": [
        {"role": "user", "content": [{"type": "text", "text": "Weather in Paris?"}]},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "c1", "name": "get_weather", "content": '{"temp": 21}'},
        {"role": "assistant", "content": "21 degrees.", "reasoning_content": "The tool said 21."}]}
    bad = {"messages": [{"role": "user", "content": "Hi"}, {"role": "tool", "content": "x"},
                        {"role": "assistant", "content": "Hello"}]}
    path = tmp_path / "tools.jsonl"
    path.write_text(json.dumps(row) + "\n" + json.dumps(bad) + "\n")
    convs, report = load_conversations(str(path), need_answers=True)
    assert len(convs) == 1 and convs[0].tools == TOOLS
    assert report.skipped == {"tool result without a tool call before it": 1}
    assert convs[0].messages == [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": "", "tool_calls": [
            {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}, "id": "c1"}]},
        {"role": "tool", "content": '{"temp": 21}', "tool_call_id": "c1", "name": "get_weather"},
        {"role": "assistant", "content": "<think>\nThe tool said 21.\n</think>\n\n21 degrees."}]


def test_build_sample_passes_the_rows_tools(qwen):
    s, cut = build_sample(qwen, Conversation(0, TOOL_CONV, TOOLS), 4096)
    assert not cut and "# Tools" in qwen.decode(s["input_ids"])
    plain, _ = build_sample(qwen, Conversation(0, TOOL_CONV[4:]), 4096)
    assert "# Tools" not in qwen.decode(plain["input_ids"])


def fake_endpoint(monkeypatch, replies):
    """An Endpoint whose server answers from ``replies`` in order; the payloads are recorded."""
    sent = []

    def request(self, path, payload=None):
        if path == "/models":
            return {"data": [{"id": "m"}]}
        sent.append(payload)
        msg = replies[len(sent) - 1]
        return {"choices": [{"message": msg, "finish_reason": "stop"}], "usage": {"completion_tokens": 3}}

    monkeypatch.setattr(Endpoint, "_request", request)
    return Endpoint("http://fake/v1", concurrency=1), sent


def test_regeneration_keeps_the_datasets_tool_exchange_as_unlearned_context(qwen, monkeypatch):
    system, steps = prompt_turns(TOOL_CONV)
    assert system == [] and [[m["role"] for m in s] for s in steps] == [["user", "assistant", "tool"], ["user"]]
    two = [{"role": "user", "content": "A"}, {"role": "user", "content": "B"}]  # separate prompts (turns format)
    assert prompt_turns(two) == ([], [[two[0]], [two[1]]])
    ep, sent = fake_endpoint(monkeypatch, [{"content": "Sunny, 21."}, {"content": "Any time."}])
    (out,), stats = regenerate_endpoint(ep, [TOOL_CONV], GenSettings(), tools=[TOOLS])
    assert stats.answers == 2 and sent[0]["tools"] == TOOLS
    assert [m["role"] for m in sent[0]["messages"]] == ["user", "assistant", "tool"]
    assert sent[0]["messages"][1] == {"role": "assistant", "content": "", "tool_calls": [CALL]}  # no bookkeeping keys
    assert out[1]["learn"] is False
    s, _ = build_sample(qwen, Conversation(0, out, TOOLS), 4096)
    assert_learned(qwen, s["input_ids"], s["loss_mask"], ["Sunny, 21.<|im_end|>", "Any time.<|im_end|>"])


# ------------------------------------------------------------------ reasoning

THINK_CONV = [
    {"role": "user", "content": "What is 2+3?"},
    {"role": "assistant", "content": "<think>\nTwo plus three.\n</think>\n\n5"},
    {"role": "user", "content": "And times 4?"},
    {"role": "assistant", "content": "<think>\nFive times four.\n</think>\n\n20"},
]


def test_reasoning_drop_learns_what_the_template_renders(qwen3):
    kw = reasoning_kwargs("drop", qwen3.chat_template)
    assert kw == {"enable_thinking": True}
    (s, _), = conversation_samples(qwen3, Conversation(0, THINK_CONV), 4096, reasoning="drop", template_kwargs=kw)
    text = qwen3.decode(s["input_ids"])
    assert "Two plus three" not in text  # dropped from history, as the template does
    assert_learned(qwen3, s["input_ids"], s["loss_mask"],
                   ["5<|im_end|>", "<think>\nFive times four.\n</think>\n\n20<|im_end|>"])


def test_reasoning_keep_learns_every_turns_thinking_in_its_own_context(qwen3):
    kw = reasoning_kwargs("keep", qwen3.chat_template)
    samples = conversation_samples(qwen3, Conversation(0, THINK_CONV), 4096, reasoning="keep", template_kwargs=kw)
    assert len(samples) == 2
    (a, _), (b, _) = samples
    assert_learned(qwen3, a["input_ids"], a["loss_mask"], ["<think>\nTwo plus three.\n</think>\n\n5<|im_end|>"])
    assert "Two plus three" not in qwen3.decode(b["input_ids"])  # the context the target had for turn 2
    assert_learned(qwen3, b["input_ids"], b["loss_mask"], ["<think>\nFive times four.\n</think>\n\n20<|im_end|>"])


def test_regenerated_reasoning_asks_for_thinking_and_learns_the_emitted_ids(qwen3, monkeypatch):
    ep, sent = fake_endpoint(monkeypatch, [{"content": "5", "reasoning_content": "Two plus three."},
                                           {"content": "20", "reasoning_content": "Five times four."}])
    kw = reasoning_kwargs("keep", qwen3.chat_template)
    (out,), _ = regenerate_endpoint(ep, [THINK_CONV], GenSettings(), template_kwargs=kw)
    assert all(p["chat_template_kwargs"] == {"enable_thinking": True} for p in sent)
    assert [m["content"] for m in out if m["role"] == "assistant"] == [m["content"] for m in THINK_CONV[1::2]]
    # local regeneration records the emitted ids: an earlier answer whose thinking the template
    # dropped is still learned (its answer ids are the end of what the target emitted)
    answer1 = {"role": "assistant", "content": THINK_CONV[1]["content"],
               "token_ids": qwen3(THINK_CONV[1]["content"])["input_ids"] + [qwen3.convert_tokens_to_ids("<|im_end|>")]}
    msgs = [THINK_CONV[0], answer1, *THINK_CONV[2:]]
    tok = tokenize_conversation(qwen3, [{k: m[k] for k in ("role", "content")} for m in msgs], **kw)
    ids, mask, unlearned = exact_answer_labels(tok, msgs)
    assert unlearned == 0
    assert_learned(qwen3, ids, mask, ["5<|im_end|>", "<think>\nFive times four.\n</think>\n\n20<|im_end|>"])


def test_reasoning_needs_a_thinking_template():
    tok = AutoTokenizer.from_pretrained(SMOLLM2_TOKENIZER)
    with pytest.raises(GenDataError, match="no thinking"):
        reasoning_kwargs("keep", tok.chat_template)
    with pytest.raises(GenDataError, match="keep or drop"):
        reasoning_kwargs("both", (TEMPLATES / "qwen3_tools_thinking.jinja").read_text())


# ------------------------------------------------------------------ last turn only


def test_last_turn_only_learns_just_the_last_answer(qwen):
    s, _ = build_sample(qwen, Conversation(0, TOOL_CONV, TOOLS), 4096, last_turn_only=True)
    assert_learned(qwen, s["input_ids"], s["loss_mask"], ["You are welcome.<|im_end|>"])
    full, _ = build_sample(qwen, Conversation(0, TOOL_CONV, TOOLS), 4096)
    assert full["input_ids"] == s["input_ids"]  # the same context; only the mask differs


# ------------------------------------------------------------------ through the gen-data command


@pytest.fixture(scope="module")
def qwen_tiny_dir(tmp_path_factory):
    from tests.helpers.tiny import save_tiny

    return save_tiny(tmp_path_factory.mktemp("qwen2_tiny"), "qwen2", tokenizer_dir=QWEN_TOKENIZER,
                     num_hidden_layers=4)


def stored(out: Path):
    from safetensors.torch import load_file

    shard = load_file(next((out / "shards").glob("*.safetensors")))
    offs = shard["offsets"].tolist()
    return [(shard["input_ids"][a:b].tolist(), shard["loss_mask"][a:b].tolist()) for a, b in zip(offs, offs[1:])]


def gen_data(*args):
    from typer.testing import CliRunner

    from eagle3cli.cli import app

    return CliRunner().invoke(app, ["gen-data", *[str(a) for a in args], "--features", "none"])


def test_gen_data_learns_tool_calls_and_records_last_turn_only(qwen_tiny_dir, qwen, tmp_path):
    rows = [{"tools": TOOLS, "messages": TOOL_CONV}]
    (tmp_path / "tools.jsonl").write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    r = gen_data("--model", qwen_tiny_dir, "--data", tmp_path / "tools.jsonl", "--out", tmp_path / "a",
                 "--no-regenerate")
    assert r.exit_code == 0, r.output
    (ids, mask), = stored(tmp_path / "a")
    assert "# Tools" in qwen.decode(ids)
    assert_learned(qwen, ids, mask, [
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call><|im_end|>',
        "It is 21 degrees in Paris.<|im_end|>", "You are welcome.<|im_end|>"])
    r = gen_data("--model", qwen_tiny_dir, "--data", tmp_path / "tools.jsonl", "--out", tmp_path / "b",
                 "--no-regenerate", "--last-turn-only")
    assert r.exit_code == 0, r.output
    (ids_b, mask_b), = stored(tmp_path / "b")
    assert ids_b == ids
    assert_learned(qwen, ids_b, mask_b, ["You are welcome.<|im_end|>"])
    assert json.loads((tmp_path / "b" / "manifest.json").read_text())["run"]["last_turn_only"] is True


def test_gen_data_reasoning_keep_regenerates_with_thinking_on(qwen_tiny_dir, qwen, tmp_path):
    rows = [{"turns": ["What is 2+3?", "And times 4?"]}, {"turns": ["Name a colour."]}]
    (tmp_path / "q.jsonl").write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    r = gen_data("--model", qwen_tiny_dir, "--data", tmp_path / "q.jsonl", "--out", tmp_path / "out",
                 "--chat-template", TEMPLATES / "qwen3_tools_thinking.jinja", "--reasoning", "keep",
                 "--max-new-tokens", "3")
    assert r.exit_code == 0, r.output
    man = json.loads((tmp_path / "out" / "manifest.json").read_text())
    assert man["run"]["reasoning"] == "keep"
    regen = [json.loads(ln) for ln in (tmp_path / "out" / "regenerated" / "part-00000.jsonl").read_text().splitlines()]
    answers = [m for row in regen for m in row["messages"] if m["role"] == "assistant"]
    samples = stored(tmp_path / "out")
    assert len(samples) == len(answers)  # one sample per regenerated turn
    learned = []
    for ids, mask in samples:
        n = sum(mask)
        assert mask[len(ids) - n:] == [True] * n  # the answer ends each sample, and only it is learned
        learned.append(ids[len(ids) - n:])
        # the target answered from the thinking-on prompt (thinking off would end it with an empty think block)
        said = qwen.decode(ids[:len(ids) - n])
        assert said.endswith("<|im_start|>user\nWhat is 2+3?<|im_end|>\n<|im_start|>assistant\n") \
            or said.endswith("Name a colour.<|im_end|>\n<|im_start|>assistant\n")
    assert sorted(learned) == sorted(a["token_ids"] for a in answers)


def test_gen_data_refuses_reasoning_with_a_template_without_thinking(qwen_tiny_dir, tmp_path):
    (tmp_path / "q.jsonl").write_text(json.dumps({"turns": ["Hi"]}) + "\n")
    r = gen_data("--model", qwen_tiny_dir, "--data", tmp_path / "q.jsonl", "--out", tmp_path / "out",
                 "--reasoning", "keep")
    assert r.exit_code != 0 and "no thinking" in r.output and "Traceback" not in r.output


def test_local_regeneration_renders_the_tools_and_answers_after_the_results(qwen_tiny_dir, qwen):
    from transformers import AutoModelForCausalLM

    from eagle3cli.data.chat_mask import end_of_turn_ids
    from eagle3cli.data.regenerate import regenerate_local

    model = AutoModelForCausalLM.from_pretrained(qwen_tiny_dir).eval()
    settings = GenSettings(max_new_tokens=3, batch_size=2)
    prompts = []
    real = qwen.apply_chat_template

    def spy(messages, *a, **kw):
        if kw.get("add_generation_prompt"):
            prompts.append(real(messages, *a, **kw))
        return real(messages, *a, **kw)

    qwen.apply_chat_template = spy
    try:
        for continuous in (True, False):
            prompts.clear()
            (out,), stats = regenerate_local(model, qwen, [TOOL_CONV[:4]], settings, end_of_turn_ids(qwen),
                                             tools=[TOOLS], continuous=continuous)
            assert [m["role"] for m in out] == ["user", "assistant", "tool", "assistant"]
            assert out[1] == {**TOOL_CONV[1], "learn": False} and out[2] == TOOL_CONV[2]
            assert len(out[3]["token_ids"]) == 3 and stats.answers == 1
            assert prompts and all("# Tools" in p and p.endswith("</tool_response><|im_end|>\n<|im_start|>assistant\n")
                                   for p in prompts[-1:])
    finally:
        qwen.apply_chat_template = real
    s, _ = build_sample(qwen, Conversation(0, out, TOOLS), 4096)
    assert [i for i, m in zip(s["input_ids"], s["loss_mask"]) if m] == out[3]["token_ids"]  # the call is not learned
