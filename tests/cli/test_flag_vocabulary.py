"""One flag vocabulary (docs/cli.md): every command spells a concept the same way, every old
spelling still works for one minor version (hidden, one deprecation line), and every choice is
typed, so the parser refuses a bad value in one line before anything heavy is imported."""

from __future__ import annotations

import importlib
import inspect
import re
import subprocess
import sys
import time
from enum import Enum
from typing import Literal, get_args, get_origin, get_type_hints

import pytest
import typer
from typer.testing import CliRunner

from eagle3cli.cli import COMMANDS, app
from tests.helpers.cli import refuse

# (command, old spelling, new flag, parameter, value typed, value the command receives)
RENAMED = [
    ("gen-data", "--data", "--dataset", "data", "d.jsonl", "d.jsonl"),
    ("gen-data", "-d", "--dataset", "data", "d.jsonl", "d.jsonl"),
    ("gen-data", "--features", "--online", "features", "none", True),
    ("train", "--data", "--store", "data", "s", "s"),
    ("train", "--eval-prompts", "--prompts", "eval_prompts", "p.jsonl", "p.jsonl"),
    ("train", "--eval-samples", "--num-prompts", "eval_samples", "5", 5),
    ("train", "--eval-new-tokens", "--max-new-tokens", "eval_new_tokens", "9", 9),
    ("eval", "--data", "--prompts", "data", "p.jsonl", "p.jsonl"),
    ("eval", "--limit", "--num-prompts", "limit", "5", 5),
    ("eval", "--steps", "--chain-length", "steps", "4", 4),
    ("quickstart", "--samples", "--max-samples", "max_samples", "5", 5),
    ("quickstart", "--steps", "--max-steps", "max_steps", "6", 6),
    ("quickstart", "--eval-prompts", "--num-prompts", "num_prompts", "7", 7),
    ("convert", "--dtype", "--draft-dtype", "draft_dtype", "float16", "float16"),
    ("export-gguf", "--target", "--model", "model", "dir", "dir"),
]


VALID = {"--to": "vllm"}  # a required choice


def command_function(name: str):
    module, func = next((m, f) for n, m, f in COMMANDS if n == name)
    return getattr(importlib.import_module(f"eagle3cli.commands.{module}"), func)


def required_args(name: str) -> list[str]:
    """Placeholder values for a command's required arguments and options."""
    cmd = typer.main.get_command(app).commands[name]
    out = []
    for p in cmd.params:
        # a required flag with an old spelling is checked once the aliases are in: "(required)"
        if p.required or (p.help or "").endswith("(required)"):
            out += ["x"] if p.param_type_name == "argument" else [p.opts[0], VALID.get(p.opts[0], "x")]
    return out


def help_text(name: str) -> str:
    r = CliRunner().invoke(app, [name, "--help"], env={"COLUMNS": "1000", "NO_COLOR": "1"})
    assert r.exit_code == 0, r.output
    return r.output


def mentions(text: str, flag: str) -> bool:
    return re.search(rf"(?<![\w-]){re.escape(flag)}(?![\w-])", text) is not None


def test_the_renamed_flags_are_all_the_aliases():
    registered = {(name, old) for name, _, _ in COMMANDS
                  for _, old, _ in getattr(command_function(name), "aliases", [])}
    assert registered == {(c, old) for c, old, *_ in RENAMED}


@pytest.mark.parametrize("command, old, new, param, given, received", RENAMED)
def test_old_spelling_is_hidden_and_still_works(monkeypatch, command, old, new, param, given, received):
    text = help_text(command)
    assert mentions(text, new) and not mentions(text, old), text
    seen = {}
    monkeypatch.setattr(command_function(command), "impl", lambda **kw: seen.update(kw))
    args = [a for a in required_args(command) if a != new]
    if new in required_args(command):  # the required flag itself is given by its old name
        i = required_args(command).index(new)
        args = required_args(command)[:i] + required_args(command)[i + 2:]
    r = CliRunner().invoke(app, [command, *args, old, given], env={"COLUMNS": "1000"})
    assert r.exit_code == 0, r.output
    assert seen[param] == received
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert lines == [f"eagle3: {old} is deprecated and goes in 0.4.0: use {new}"]


def test_old_and_new_spelling_together_are_refused(monkeypatch):
    monkeypatch.setattr(command_function("gen-data"), "impl", lambda **kw: pytest.fail("ran"))
    r = CliRunner().invoke(app, ["gen-data", "-m", "x", "--dataset", "a", "--data", "b"])
    assert r.exit_code == 1
    assert "error: --data is the old name of --dataset: give --dataset only" in r.output


def test_a_missing_required_flag_is_named(monkeypatch):
    monkeypatch.setattr(command_function("gen-data"), "impl", lambda **kw: pytest.fail("ran"))
    r = CliRunner().invoke(app, ["gen-data", "-m", "x"])
    assert r.exit_code == 1 and "error: missing option --dataset" in r.output


def choice_flags() -> list[tuple[str, str, list[str]]]:
    """(command, flag, choices) of every typed choice of every command."""
    out = []
    for name, _, _ in COMMANDS:
        fn = command_function(name)
        hints = get_type_hints(getattr(fn, "impl", fn))  # hand-written commands: string annotations
        for p in inspect.signature(fn).parameters.values():
            t = hints.get(p.name, p.annotation)
            if get_origin(t) is not Literal:
                args = [a for a in get_args(t) if a is not type(None)]
                t = args[0] if len(args) == 1 else t
            if get_origin(t) is Literal:
                values = [str(v) for v in get_args(t)]
            elif isinstance(t, type) and issubclass(t, Enum):
                values = [e.value for e in t]
            else:
                continue
            option = p.default
            if getattr(option, "hidden", False):
                continue
            out.append((name, next(d for d in option.param_decls if d.startswith("--")).split("/")[0], values))
    return out


def test_every_choice_is_listed_in_help():
    flags = choice_flags()
    assert {(c, f) for c, f, _ in flags} >= {
        ("gen-data", "--format"), ("gen-data", "--reasoning"), ("gen-data", "--engine"), ("gen-data", "--dtype"),
        ("gen-data", "--regen-dtype"), ("gen-data", "--feature-dtype"), ("train", "--optimizer"),
        ("train", "--init-vocab"), ("train", "--loss-on"), ("train", "--variant"), ("train", "--keep"),
        ("train", "--mixed-precision"), ("eval", "--mode"), ("eval", "--fast"), ("eval", "--draft-weights"),
        ("eval", "--engine"), ("eval", "--baseline"), ("convert", "--to"), ("convert", "--draft-dtype"),
        ("export-gguf", "--outtype"), ("push", "--gguf")}
    helps = {}
    for command, flag, values in flags:
        text = helps.setdefault(command, help_text(command))
        assert "|".join(values) in text, (command, flag)


def test_a_bad_choice_is_one_line_from_the_parser_before_any_import(tmp_path):
    argvs = [[c, *required_args(c), flag, "banana"] for c, flag, _ in choice_flags()]
    res = refuse(argvs)
    assert res["heavy"] == []  # nothing of the library was imported: refused by the parser
    for run in res["runs"]:
        lines = [ln for ln in run["stderr"].splitlines() if ln.strip()]
        assert run["code"] == 2 and len(lines) == 1, run
        assert lines[0].startswith("error: Invalid value for") and "'banana' is not one of" in lines[0], run
        assert run["argv"][-2] in lines[0] and f"eagle3 {run['argv'][0]} --help" in lines[0], run


def test_a_bad_value_is_refused_by_validate_before_any_import(tmp_path):
    argvs = [["train", "--model", "x", "--lr", "7"],
             ["train", "--model", "x", "--store", "s", "--eval-every", "-1"],
             ["gen-data", "-m", "x", "--dataset", "d", "--temperature", "-1"],
             ["gen-data", "-m", "x", "--dataset", "d", "--online", "--engine", "vllm"],
             ["eval", "-m", "x", "-d", "y", "--chain-length", "0", "-o", str(tmp_path / "o")]]
    res = refuse(argvs)
    assert res["heavy"] == []
    want = ["--lr must lie in (0, 1]", "--eval-every must be 0 (off)", "--temperature must be 0 (greedy)",
            "--engine vllm captures features", "--chain-length must be at least 1"]
    for run, words in zip(res["runs"], want):
        lines = [ln for ln in run["stderr"].splitlines() if ln.strip()]
        assert run["code"] == 1 and len(lines) == 1 and words in lines[0], run


def test_train_refuses_a_bad_optimizer_within_two_seconds():
    """As a new user would type it: no Hub, no torch, one line."""
    t0 = time.perf_counter()
    r = subprocess.run([sys.executable, "-m", "eagle3cli.cli", "train", "--model", "x", "--optimizer", "banana"],
                       capture_output=True, text=True, timeout=60, env={"COLUMNS": "1000", "PATH": "/usr/bin:/bin"})
    took = time.perf_counter() - t0
    assert r.returncode == 2 and r.stderr.strip().count("\n") == 0, r.stderr
    assert "--optimizer" in r.stderr and "'banana' is not one of 'adamw', 'muon'" in r.stderr
    assert took < 2.0, took


def test_a_flag_of_the_other_draft_family_is_refused_in_one_line():
    """A DFlash setting typed for an EAGLE-3 run (or the reverse) would change nothing: refused before
    anything loads, naming the flags and the --draft-type that reads them; its own family's flags pass."""
    argvs = [["train", "--model", "x", "--store", "s", "--recipe", "none", "--block-size", "8"],
             ["train", "--model", "x", "--store", "s", "--recipe", "none", "--draft-type", "dflash",
              "--ttt-steps", "3", "--draft-vocab-size", "8000"],
             ["train", "--model", "x", "--store", "s", "--recipe", "none", "--draft-type", "dflash",
              "--block-size", "8", "--num-anchors", "32", "--print-config"]]
    res = refuse(argvs)
    assert res["heavy"] == []
    eagle, dflash, ok = res["runs"]
    assert eagle["code"] == 1 and eagle["lines"] == [
        "error: --block-size: only a --draft-type dflash draft reads it, and this run trains eagle3; "
        "add --draft-type dflash or drop --block-size"], eagle
    assert dflash["code"] == 1 and dflash["lines"] == [
        "error: --ttt-steps, --draft-vocab-size: only a --draft-type eagle3 draft reads them, and this run "
        "trains dflash; add --draft-type eagle3 or drop --ttt-steps, --draft-vocab-size"], dflash
    assert ok["code"] == 0 and ok["lines"] == [], ok
