from pathlib import Path

from typer.testing import CliRunner

from eagle3cli import __version__
from eagle3cli.cli import COMMANDS, app
from eagle3cli.cli_docs import render

DOCS = Path(__file__).resolve().parents[2] / "docs" / "cli.md"


def test_help_lists_every_command():
    r = CliRunner().invoke(app, ["--help"])
    assert r.exit_code == 0
    for name in ["gen-data", "train", "eval", "push", "layers", "inspect", "recipes", "quickstart"]:
        assert name in r.output
    assert "not built yet" not in r.output  # every advertised command is implemented
    assert {c[0] for c in COMMANDS} >= {"gen-data", "train", "eval", "push", "layers", "inspect"}


def test_version():
    r = CliRunner().invoke(app, ["--version"])
    assert r.exit_code == 0 and r.output.strip() == f"eagle3 {__version__}"


def test_cli_reference_is_current():
    assert DOCS.read_text() == render(), "docs/cli.md is stale: python -m eagle3cli.cli_docs > docs/cli.md"


def test_layers_shows_both_families_streams(smol_tiny_dir):
    r = CliRunner().invoke(app, ["layers", "-m", str(smol_tiny_dir)])
    assert r.exit_code == 0, r.output
    lines = {line.split()[0] + " " + line.split()[1]: line for line in r.output.splitlines() if line.strip()}
    assert "layers j         2, 4, 5 " in lines["layers j"]  # EAGLE-3 on 8 layers
    assert "1, 2, 3, 4, 5 " in lines["dflash k"] and "2, 3, 4, 5, 6 " in lines["dflash j"]
