"""Recipes and the precedence defaults < recipe < command-line flags."""

import dataclasses
import json

import pytest
import yaml
from typer.testing import CliRunner

from eagle3cli.cli import app
from eagle3cli.commands.train import train as train_command
from eagle3cli.config.train_config import (
    FAMILIES,
    TrainConfig,
    load_recipe,
    recipe_for_model_type,
    recipe_names,
    recipe_source,
    resolve,
)
from tests.helpers.tiny import ARCHS, tiny_config

runner = CliRunner()
FAMILY_OF_TINY = {"llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3", "mistral": "mistral",
                  "gemma3_text": "gemma", "phi3": "phi"}


def cli_config(*args) -> dict:
    r = runner.invoke(app, ["train", *args, "--print-config"])
    assert r.exit_code == 0, r.output
    return json.loads(r.stdout[r.stdout.index("{"):])


def test_six_family_recipes_ship_and_validate():
    assert recipe_names() == ["gemma", "llama", "mistral", "phi", "qwen2", "qwen3"]
    for name in recipe_names():
        _, settings = load_recipe(name)
        assert settings, name
        assert set(settings) <= set(TrainConfig.names())
        raw = yaml.safe_load(recipe_source(name)[1])
        assert raw["description"] and "#" in recipe_source(name)[1]  # says why, in comments
    assert load_recipe("gemma")[1]["warmup_ratio"] == 0.03  # YAML's "0.03" arrives as a float
    assert load_recipe("phi")[1]["draft_vocab_size"] == "32064"


def test_auto_picks_by_model_type_for_every_tiny_arch():
    for arch in ARCHS:
        assert recipe_for_model_type(tiny_config(arch).model_type) == FAMILY_OF_TINY[arch]
    assert set(FAMILIES.values()) == set(recipe_names())
    cfg, used = resolve("auto", {}, "qwen3")
    assert used == "qwen3" and cfg.max_length == 4096
    cfg, used = resolve("auto", {}, "gpt2")  # no family: plain defaults
    assert used is None and cfg == TrainConfig()


def test_precedence_defaults_recipe_flags():
    cfg, used = resolve("gemma", {"lr": 1e-3, "ttt_steps": None})
    assert used == "gemma"
    assert cfg.lr == 1e-3  # flag beats recipe
    assert cfg.warmup_ratio == 0.03  # recipe beats default
    assert cfg.ttt_steps == 7 and cfg.step_decay == 0.8 and cfg.grad_clip == 0.5  # defaults
    cfg, _ = resolve("none", {"epochs": 5})
    assert cfg == dataclasses.replace(TrainConfig(), epochs=5)


def test_every_config_field_is_a_cli_flag():
    params = train_command.__signature__.parameters
    assert set(TrainConfig.names()) <= set(params)
    r = runner.invoke(app, ["train", "--help"], env={"COLUMNS": "250"})
    from eagle3cli.config.options import flag_of

    for name in TrainConfig.names():  # the flag is the field's name, or its vocabulary word (docs/cli.md)
        assert flag_of(TrainConfig, name) in r.stdout, name


def test_cli_overrides_recipe(tmp_path):
    cfg = cli_config("--recipe", "qwen3", "--lr", "2e-4", "--no-online", "--draft-vocab-size", "auto")
    assert cfg["recipe"] == "qwen3" and cfg["lr"] == 2e-4 and cfg["max_length"] == 4096
    assert cfg["draft_vocab_size"] == "auto" and cfg["online"] is False
    own = tmp_path / "mine.yaml"
    own.write_text("lr: 3.0e-5\nepochs: 9\nonline: true\n")
    cfg = cli_config("--recipe", str(own), "--epochs", "2")
    assert (cfg["lr"], cfg["epochs"], cfg["online"]) == (3e-5, 2, True)
    cfg = cli_config("--recipe", str(own), "--no-online")
    assert cfg["online"] is False


def test_auto_reads_the_store_manifest(tmp_path):
    (tmp_path / "manifest.json").write_text(json.dumps({"model_type": "gemma3_text"}))
    cfg = cli_config("--data", str(tmp_path))
    assert cfg["recipe"] == "gemma" and cfg["warmup_ratio"] == 0.03


def test_bad_recipes_are_one_line_errors(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("learning_rate: 1e-4\n")
    with pytest.raises(ValueError, match="unknown setting 'learning_rate'"):
        resolve(str(bad), {})
    bad.write_text("ttt_steps: seven\n")
    with pytest.raises(ValueError, match="ttt_steps must be of type int"):
        resolve(str(bad), {})
    with pytest.raises(ValueError, match="unknown recipe 'lama'"):
        resolve("lama", {})
    r = runner.invoke(app, ["train", "--recipe", "lama", "--print-config"])
    assert r.exit_code == 1 and "unknown recipe 'lama'" in r.output


def test_recipes_command_lists_them():
    r = runner.invoke(app, ["recipes"], env={"COLUMNS": "250"})
    assert r.exit_code == 0
    for name in recipe_names():
        assert name in r.stdout
    r = runner.invoke(app, ["recipes", "gemma"])
    assert "warmup_ratio: 0.03" in r.stdout
