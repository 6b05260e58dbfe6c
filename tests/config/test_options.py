"""The commands' flags come from option dataclasses, the eight target-loading
options from one of them (TargetOptions), and every user-facing error shares Eagle3Error."""

from __future__ import annotations

import dataclasses
import importlib
import inspect
import pkgutil
from pathlib import Path

import pytest
import typer
from typer.testing import CliRunner

import eagle3cli
from eagle3cli.cli import app
from eagle3cli.config.options import TARGET_FIELDS, EvalOptions, GenDataOptions, TargetOptions, parse_tree
from eagle3cli.config.train_config import TrainConfig
from eagle3cli.core.errors import Eagle3Error, OptionError
from eagle3cli.model.target import TargetSpec

PACKAGE = Path(eagle3cli.__file__).parent
TARGET = {f.name: f for f in dataclasses.fields(TargetOptions)}


def invoke(*args, env=None):
    return CliRunner().invoke(app, [str(a) for a in args], env={"COLUMNS": "500", **(env or {})})


def options_of(command: str) -> dict[str, object]:
    """name -> click option of one ``eagle3`` command."""
    group = typer.main.get_command(app)
    return {p.name: p for p in group.commands[command].params}


def test_the_eight_target_options():
    assert TARGET_FIELDS == ("model", "revision", "dtype", "device", "load_in_8bit", "load_in_4bit", "adapter",
                             "trust_remote_code")
    for cls in (TargetSpec, TrainConfig, GenDataOptions, EvalOptions):
        assert issubclass(cls, TargetOptions), cls


@pytest.mark.parametrize("command", ["gen-data", "eval"])
def test_gen_data_and_eval_target_flags_are_the_shared_fields(command):
    opts = options_of(command)
    for name, f in TARGET.items():
        o = opts[name]
        assert o.help == f.metadata["help"]
        assert "--" + name.replace("_", "-") in o.opts
        assert o.default == (None if name == "model" else f.default)
    assert opts["model"].required and opts["model"].opts == ["--model", "-m"]
    assert opts["dtype"].default == "auto" and opts["load_in_8bit"].default is False
    # the first eight flags, in TargetOptions' order
    assert [p for p in opts if p != "help"][:8] == list(TARGET_FIELDS)


def test_train_target_flags_are_the_shared_fields_left_unset_for_recipes():
    opts = options_of("train")
    for name, f in TARGET.items():
        o = opts[name]
        shown = {"model": "the store's target"}.get(name, f.default)
        want = f.metadata["help"] if "(default:" in f.metadata["help"] else f"{f.metadata['help']} (default: {shown})"
        assert o.help == want
        assert o.default is None  # "not given": a recipe's value stands
    assert opts["dtype"].help == ("What the target computes in (auto: bf16 on GPU, fp32 on CPU; for eval's greedy "
                                  "fast path bf16 on a CPU with AMX, checked exact at start-up). (default: auto)")
    assert opts["load_in_8bit"].secondary_opts == ["--no-load-in-8bit"]
    assert not opts["model"].required


@pytest.mark.parametrize("command", ["inspect", "layers", "convert"])
def test_commands_reading_only_the_config_share_revision_and_trust_remote_code(command):
    opts = options_of(command)
    for name in ("revision", "trust_remote_code"):
        assert opts[name].help == TARGET[name].metadata["help"]
        assert opts[name].default == TARGET[name].default


def test_each_target_help_is_written_once_in_the_package():
    sources = "\n".join(p.read_text() for p in PACKAGE.rglob("*.py"))
    for name, f in TARGET.items():
        start = f.metadata["help"][:30]  # short enough to sit on one source line
        assert sources.count(start) == 1, (name, start)


# ---------------------------------------------------------------- gen-data


@pytest.fixture
def gen_data_gets(monkeypatch):
    """What the gen-data command hands the library, without running it."""
    import eagle3cli.data.gen_data as gd

    seen = {}

    def fake_run(opts, spec, console=None):
        seen.update(opts=opts, spec=spec)
        return None

    monkeypatch.setattr(gd, "run", fake_run)
    return seen


def test_gen_data_flags_become_options_and_spec(gen_data_gets, tmp_path):
    res = invoke("gen-data", "-m", "x/y", "--dataset", "d.jsonl", "-o", tmp_path / "s", "--layers", "2,5,7",
                 "--engine", "vllm", "--vllm-args", '{"gpu_memory_utilization": 0.8}', "--chat-template", "t.jinja",
                 "--dtype",
                 "float32", "--no-regenerate", "-n", 3, env={"EAGLE3_API_KEY": "k2", "OPENAI_API_KEY": None})
    assert res.exit_code == 0, res.output
    opts, spec = gen_data_gets["opts"], gen_data_gets["spec"]
    assert opts.layers == (2, 5, 7)
    assert opts.vllm_args == {"gpu_memory_utilization": 0.8}
    assert opts.chat_template == "t.jinja" and isinstance(opts.chat_template, str)
    assert opts.out == tmp_path / "s" and opts.data == "d.jsonl" and opts.max_samples == 3
    assert opts.regenerate is False and opts.capture_tokens == 0  # internal: 0 = samples.capture_budget
    assert opts.api_key == "k2"  # EAGLE3_API_KEY when OPENAI_API_KEY is unset
    assert spec == TargetSpec(model="x/y", dtype="float32")


def test_openai_api_key_wins(gen_data_gets, tmp_path):
    res = invoke("gen-data", "-m", "x/y", "--dataset", "d.jsonl", "-o", tmp_path / "s",
                 env={"EAGLE3_API_KEY": "k2", "OPENAI_API_KEY": "k1"})
    assert res.exit_code == 0, res.output
    assert gen_data_gets["opts"].api_key == "k1"


@pytest.mark.parametrize("flags, message", [
    (["--layers", "a,b"], "error: --layers must be comma-separated integers, got 'a,b'"),
    (["--vllm-args", "[1]"], "error: --vllm-args must be a JSON object of vllm.LLM keyword arguments"),
    (["--vllm-args", "{"], "error: --vllm-args is not JSON (Expecting property name enclosed in double quotes: "
                           "line 1 column 2 (char 1))"),
])
def test_gen_data_bad_flag_is_one_line(gen_data_gets, tmp_path, flags, message):
    res = invoke("gen-data", "-m", "x/y", "--dataset", "d.jsonl", "-o", tmp_path / "s", *flags)
    assert res.exit_code == 1
    assert [ln for ln in res.output.splitlines() if ln.startswith("error:")] == [message]
    assert gen_data_gets == {}  # refused before the library ran


def test_empty_vllm_args_is_none_as_before():
    from eagle3cli.config.options import json_object

    assert json_object("  ") is None and json_object('{"enforce_eager": true}') == {"enforce_eager": True}


# ---------------------------------------------------------------- eval


def eval_options(tmp_path, **kw) -> EvalOptions:
    return EvalOptions(**{"model": "m", "draft": "d", "out": tmp_path / "o", **kw})


@pytest.mark.parametrize("kw, shape", [
    ({"device": "cpu"}, (True, 60, 8, 10)),  # measured on a CPU: auto
    ({"device": "cuda:1"}, (False, 60, 8, 10)),
    ({"device": "cpu", "tree": "auto"}, (True, 60, 8, 10)),
    ({"device": "cpu", "tree": "5,3"}, (False, 5, 3, 10)),
    ({"tree": "30,6,8"}, (False, 30, 6, 8)),
])
def test_eval_tree_defaults_by_device(tmp_path, kw, shape):
    opts = eval_options(tmp_path, **kw)
    opts.validate()
    assert opts.tree_shape() == shape


def test_eval_config_from_options(tmp_path):
    from eagle3cli.evaluate.eval_config import EvalConfig

    cfg = EvalConfig.from_options(eval_options(tmp_path, task=["gsm8k"], data="p.jsonl", tree="20,5,4",
                                               baseline="prompt-lookup", seed=3, temperature=0.5, fast="off"))
    assert (cfg.tasks, cfg.data, cfg.total_tokens, cfg.depth, cfg.top_k, cfg.tree_auto) == \
        (["gsm8k"], "p.jsonl", 20, 5, 4, False)
    assert cfg.prompt_lookup is True and cfg.seed == 3 and cfg.temperature == 0.5 and cfg.fast == "off"


@pytest.mark.parametrize("kw, message", [
    ({"engine": "vllm-x"}, "--engine must be one of eagle3, llama.cpp, vllm, got 'vllm-x'"),
    ({"engine": "vllm", "temperature": 0.7}, "--engine vllm measures greedy decoding: drop --temperature"),
    ({"engine_only": True}, "--engine-only needs --engine llama.cpp or vllm"),
    ({"engine": "llama.cpp", "temperature": 0.7}, "--engine llama.cpp measures greedy decoding: drop --temperature"),
    ({"mode": "beam"}, "--mode must be one of tree, chain, got 'beam'"),
    ({"baseline": "ngram"}, "--baseline must be one of prompt-lookup, got 'ngram'"),
    ({"top_p": 0.0}, "--temperature must be >= 0 and --top-p in (0, 1]"),
    ({"temperature": float("nan")}, "--temperature must be >= 0 and --top-p in (0, 1]"),
    ({"steps": 0}, "--max-new-tokens and --chain-length must be at least 1"),
    ({"limit": 0}, "--num-prompts must be at least 1, got 0"),
    ({"fast": "yes"}, "--fast must be one of auto, on, off, got 'yes'"),
    ({"draft_weights": "int2"}, "--draft-weights must be one of auto, full, int8, int4, got 'int2'"),
    ({"task": ["a", "b"], "data": "p.jsonl"}, "--prompts gives the prompts of one task; pass a single --task with it"),
    ({"tree": "8"}, "--tree must be 'auto' or TOTAL,DEPTH[,TOPK] with positive integers, got '8'"),
    ({"tree": "8,0"}, "--tree must be 'auto' or TOTAL,DEPTH[,TOPK] with positive integers, got '8,0'"),
])
def test_eval_options_refuse(tmp_path, kw, message):
    with pytest.raises(OptionError) as e:
        eval_options(tmp_path, device="cpu", **kw).validate()
    assert str(e.value) == message


def test_parse_tree_is_a_value_error_too():
    with pytest.raises(ValueError):
        parse_tree("x,y")


def test_eval_bug_keeps_its_traceback(monkeypatch, tmp_path):
    """No bare ``except ValueError`` in the eval command: a bug is not an "error:" line."""
    import eagle3cli.model.target as target

    def bug(spec):
        raise ValueError("a bug, not a user error")

    monkeypatch.setattr(target, "load_config", bug)
    res = invoke("eval", "-m", "x/y", "-d", tmp_path, "-o", tmp_path / "o", "--device", "cpu")
    assert isinstance(res.exception, ValueError) and "error:" not in res.output


def test_eval_bad_flag_is_one_line_before_loading(monkeypatch, tmp_path):
    import eagle3cli.model.target as target

    monkeypatch.setattr(target, "load_config", lambda spec: pytest.fail("validated after loading"))
    res = invoke("eval", "-m", "x/y", "-d", tmp_path, "-o", tmp_path / "o", "--temperature", "-1")
    assert res.exit_code == 1
    assert [ln for ln in res.output.splitlines() if ln.startswith("error:")] == [
        "error: --temperature must be >= 0 and --top-p in (0, 1]"]


# ---------------------------------------------------------------- train and the spec


def test_spec_of_a_train_config():
    cfg = TrainConfig(model="m", dtype="float16", adapter="a", online=True)
    assert TargetSpec.of(cfg, device="cpu") == TargetSpec(model="m", dtype="float16", device="cpu", adapter="a")
    assert list(cfg.to_dict())[:8] == list(TARGET_FIELDS)


# ---------------------------------------------------------------- one error base

# Exceptions that never reach the user: each is caught where it is raised and counted or mapped.
INTERNAL = {
    "BadRow": "sources: a row that is skipped and counted",
    "MaskError": "chat_mask: a conversation that is skipped and counted",
    "EndpointRejected": "endpoint: a request the server refused, counted as a skip",
    "Fault": "endpoint: a failed try of a request, tried again until --endpoint-patience ends",
    "Stopped": "endpoint_pacing: another request gave up; this one ends and the first one's error is raised",
    "Skip": "warm_start: a part of the layer that does not fit, named in one line and left out",
}


def exception_classes() -> dict[str, type]:
    out = {}
    for m in pkgutil.walk_packages(eagle3cli.__path__, "eagle3cli."):
        module = importlib.import_module(m.name)
        for name, obj in inspect.getmembers(module, inspect.isclass):
            if issubclass(obj, BaseException) and obj.__module__ == m.name:
                out[f"{m.name}.{name}"] = obj
    return out


def test_every_user_facing_exception_is_an_eagle3_error():
    classes = exception_classes()
    assert len(classes) >= 20  # the walk found them
    stray = sorted(n for n, c in classes.items() if not issubclass(c, Eagle3Error)
                   and n.rsplit(".", 1)[1] not in INTERNAL)
    assert stray == []
    for name in INTERNAL:
        assert any(n.endswith("." + name) for n in classes), name  # the allow-list stays current
