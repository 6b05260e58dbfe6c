"""Dataset loading: every supported row shape, bad rows counted with their lines, presets."""

import json

import pytest

from eagle3cli.data import raw_rows
from eagle3cli.data.raw_rows import SourceError
from eagle3cli.data.sources import Conversation, load_conversations, with_system


def write_jsonl(path, rows):
    path.write_text("\n".join(r if isinstance(r, str) else json.dumps(r) for r in rows) + "\n")
    return path


U = lambda c: {"role": "user", "content": c}  # noqa: E731
A = lambda c: {"role": "assistant", "content": c}  # noqa: E731
S = lambda c: {"role": "system", "content": c}  # noqa: E731


@pytest.mark.parametrize("row, expected, fmt", [
    ({"conversations": [{"from": "system", "value": "sys"}, {"from": "human", "value": "q"},
                        {"from": "gpt", "value": "a"}]}, [S("sys"), U("q"), A("a")], "sharegpt"),
    ({"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]}, [U("q"), A("a")],
     "messages"),
    ({"instruction": "Do it", "input": "on this", "output": "done"}, [U("Do it\n\non this"), A("done")], "alpaca"),
    ({"instruction": "Do it", "input": "", "output": "done"}, [U("Do it"), A("done")], "alpaca"),
    ({"turns": ["q1", "q2"]}, [U("q1"), U("q2")], "turns"),
    ({"turns": ["q1"], "reference": ["r1"]}, [U("q1"), A("r1")], "turns"),
    ({"question": "2+2?", "answer": "4"}, [U("2+2?"), A("4")], "prompt"),
    ({"prompt": "hello"}, [U("hello")], "prompt"),
])
def test_formats_detected_and_normalised(tmp_path, row, expected, fmt):
    convs, report = load_conversations(str(write_jsonl(tmp_path / "d.jsonl", [row])))
    assert report.format == fmt
    assert [c.messages for c in convs] == [expected]


def test_sharegpt_leading_answers_dropped_and_repeats_merged(tmp_path):
    row = {"conversations": [{"from": "gpt", "value": "orphan"}, {"from": "human", "value": "a"},
                             {"from": "human", "value": "b"}, {"from": "chatgpt", "value": "c"}]}
    convs, _ = load_conversations(str(write_jsonl(tmp_path / "d.jsonl", [row])))
    assert convs[0].messages == [U("a\n\nb"), A("c")]


def test_bad_rows_skipped_counted_with_lines(tmp_path):
    good = {"conversations": [{"from": "human", "value": "q"}, {"from": "gpt", "value": "a"}]}
    rows = [
        good,                                                                       # 1
        "{not json",                                                                # 2
        {"conversations": []},                                                      # 3
        {"conversations": [{"value": "no role"}]},                                  # 4
        {"conversations": [{"from": "human", "value": ["x"]}]},                     # 5
        {"conversations": [{"from": "human", "value": "only a question"}]},         # 6
        {"conversations": [{"from": "gpt", "value": "only an answer"}]},            # 7
        {"conversations": [{"from": "alien", "value": "?"}]},                       # 8
        {"conversations": [{"from": "human", "value": "  "}, {"from": "gpt", "value": "a"}]},  # 9
        good,                                                                       # 10
    ]
    path = write_jsonl(tmp_path / "d.jsonl", rows)
    convs, report = load_conversations(str(path), need_answers=True)
    assert [c.id for c in convs] == [0, 9]
    assert report.rows == 10 and report.kept == 2
    assert dict(report.skipped) == {
        "malformed JSON": 1, "empty conversation": 2, "turn without a role": 1,
        "non-string content in a user turn": 1, "no assistant turn": 1, "unknown role 'alien'": 1,
        "empty user turn": 1,
    }
    assert report.examples[:3] == [("d.jsonl:2", "malformed JSON"), ("d.jsonl:3", "empty conversation"),
                                   ("d.jsonl:4", "turn without a role")]
    assert "skipped 8" in report.summary() and "d.jsonl:2 (malformed JSON)" in report.summary()
    # Prompts alone are fine when the target will answer them.
    convs, report = load_conversations(str(path), need_answers=False)
    assert [c.id for c in convs] == [0, 5, 9]
    with pytest.raises(SourceError, match=r"d.jsonl:2: malformed JSON \(--strict\)"):
        load_conversations(str(path), strict=True)


def test_forced_format_mismatch_reports_reason(tmp_path):
    path = write_jsonl(tmp_path / "d.jsonl", [{"conversations": [{"from": "human", "value": "q"}]}])
    with pytest.raises(SourceError, match="no 'instruction' field"):
        load_conversations(str(path), fmt="alpaca")
    with pytest.raises(SourceError, match="unknown --format 'chatml'"):
        load_conversations(str(path), fmt="chatml")


def test_unknown_shape(tmp_path):
    path = write_jsonl(tmp_path / "d.jsonl", [{"text": "plain"}])
    with pytest.raises(SourceError, match=r"unknown row shape \(pass --format\)"):
        load_conversations(str(path))


def test_truncated_json_array_decoded_object_by_object(tmp_path):
    rows = [{"id": str(i), "conversations": [{"from": "human", "value": f"q{i}"}, {"from": "gpt", "value": "a"}]}
            for i in range(3)]
    text = "[\n" + ",\n".join(json.dumps(r) for r in rows) + ',\n{"id": "3", "conversations": [{"from": "hu'
    path = tmp_path / "sharegpt.json"
    path.write_text(text)
    convs, report = load_conversations(str(path))
    assert [c.messages[0]["content"] for c in convs] == ["q0", "q1", "q2"]
    assert report.examples == [("sharegpt.json:5", "truncated JSON (end of file)")]
    # A complete array (and a dict of id -> row) load the plain way.
    path.write_text(json.dumps(rows))
    assert len(load_conversations(str(path))[0]) == 3
    path.write_text(json.dumps({r["id"]: r for r in rows}))
    assert len(load_conversations(str(path))[0]) == 3


def test_parquet_through_datasets(tmp_path):
    import datasets

    rows = {"messages": [[{"role": "user", "content": f"q{i}"}, {"role": "assistant", "content": f"a{i}"}]
                         for i in range(4)]}
    datasets.Dataset.from_dict(rows).to_parquet(str(tmp_path / "d.parquet"))
    convs, report = load_conversations(str(tmp_path / "d.parquet"), max_samples=3)
    assert report.format == "messages"
    assert [c.messages for c in convs] == [[U(f"q{i}"), A(f"a{i}")] for i in range(3)]


def test_shuffle_and_max_samples_are_seeded(tmp_path):
    path = write_jsonl(tmp_path / "d.jsonl", [{"prompt": f"p{i}"} for i in range(20)])
    a, _ = load_conversations(str(path), shuffle=True, seed=1, max_samples=5)
    b, _ = load_conversations(str(path), shuffle=True, seed=1, max_samples=5)
    c, _ = load_conversations(str(path), shuffle=True, seed=2, max_samples=5)
    assert [x.id for x in a] == [x.id for x in b] != [x.id for x in c]
    assert all(x.messages == [U(f"p{x.id}")] for x in a)
    first, _ = load_conversations(str(path), max_samples=5)
    assert [x.id for x in first] == [0, 1, 2, 3, 4]


def test_presets_resolve_to_hub_ids(monkeypatch):
    calls = []

    def fake_load(*args, **kw):
        calls.append((args, kw))
        return [{"question": "q", "answer": "a"}]

    monkeypatch.setattr(raw_rows, "_load_dataset", fake_load)
    convs, report = load_conversations("gsm8k")
    assert calls == [(("openai/gsm8k", "main"), {"split": "train", "streaming": False})]
    assert convs[0].messages == [U("q"), A("a")]
    load_conversations("some/dataset", split="test", subset="x", streaming=True)
    assert calls[-1] == (("some/dataset", "x"), {"split": "test", "streaming": True})
    load_conversations("ultrachat")
    assert calls[-1][0][0] == "HuggingFaceH4/ultrachat_200k" and calls[-1][1]["split"] == "train_sft"


def test_missing_and_unsupported_files(tmp_path):
    with pytest.raises(SourceError, match="no such file"):
        load_conversations(str(tmp_path / "nope.jsonl"))
    (tmp_path / "d.csv").write_text("a,b\n")
    with pytest.raises(SourceError, match="unsupported file type .csv"):
        load_conversations(str(tmp_path / "d.csv"))


def test_unreachable_hub_is_one_line(monkeypatch):
    with pytest.raises(SourceError, match="could not load dataset no-such/dataset-xyz") as e:
        load_conversations("no-such/dataset-xyz")
    assert "\n" not in str(e.value)


def test_with_system():
    convs = [Conversation(0, [S("old"), U("q"), A("a")]), Conversation(1, [U("q")])]
    assert [c.messages for c in with_system(convs, "new")] == [[S("new"), U("q"), A("a")], [S("new"), U("q")]]
    assert [c.messages for c in with_system(convs, "")] == [[U("q"), A("a")], [U("q")]]
