"""Every ``eagle3 <command> ...`` line a user can copy (README, docs, model card template, recipe
comments, benchmark scripts, commands the package prints) uses only flags that command shows in
``--help``: no old spelling (docs/cli.md's table), which would still run but print a deprecation
line, and no flag that does not exist."""

from __future__ import annotations

import re
from pathlib import Path

import typer

from eagle3cli.cli import COMMANDS, app

ROOT = Path(__file__).resolve().parents[2]
# docs/cli.md is generated from the app itself (tests/cli/test_cli.py keeps it current); CHANGELOG.md
# names the old spellings on purpose
SCANNED = (["README.md"] + sorted(f"docs/{p.name}" for p in (ROOT / "docs").glob("*.md") if p.name != "cli.md")
           + [str(p.relative_to(ROOT)) for d in ("templates", "recipes", "benchmarks")
              for p in sorted((ROOT / d).glob("*")) if p.suffix in (".md", ".yaml", ".py", ".sh")]
           + [str(p.relative_to(ROOT)) for p in sorted((ROOT / "eagle3cli").rglob("*.py"))])

NAMES = "|".join(re.escape(n) for n, _, _ in sorted(COMMANDS, key=lambda c: -len(c[0])))
# `eagle3 train`, `-m eagle3cli.cli train`, and a subprocess list's "eagle3", "train"
START = re.compile(rf"""(?:(?<![\w/.-])eagle3|eagle3cli\.cli)["']?(?:\s|["'],\s*["'])+({NAMES})(?![\w-])""")
FLAG = re.compile(r"""(?<![\w./$-])(--?[A-Za-z][\w-]*)""")


def visible_flags() -> dict[str, set[str]]:
    group = typer.main.get_command(app)
    return {name: {"--help"} | {o for p in cmd.params if not getattr(p, "hidden", False)
                                for o in p.opts + p.secondary_opts}
            for name, cmd in group.commands.items()}


def command_tail(text: str, start: int) -> str:
    """The rest of one command from ``start``: up to the end of the line, an inline-code span, a
    shell comment or a pipe or ``&&`` (a ``|`` inside ``[a | b]`` alternatives is part of it)."""
    depth, out, i = 0, [], start
    while i < len(text):
        c = text[i]
        if c in "\n`" or text.startswith((" #", "&&", ";"), i) or (c == "|" and depth == 0):
            break
        depth += (c == "[") - (c == "]")
        out.append(c)
        i += 1
    return "".join(out)


def flags_of(tail: str) -> list[str]:
    """The flags in a command's words, up to where prose begins (two plain words in a row that
    are no flag's value: "eagle3 train with each of ...")."""
    flags, after_flag, plain = [], False, 0
    for word in re.sub(r"[\"',\x01\[\]|]", " ", tail).split():
        if FLAG.fullmatch(word.split("=")[0]):
            flags.append(word.split("=")[0])
            after_flag, plain = "=" not in word, 0
            continue
        plain = plain + 1 if re.fullmatch(r"[a-z]+", word) and not after_flag else 0
        if plain == 2:
            break
        after_flag = False
    return flags


def commands_in(text: str):
    """(line number, command, flags) of every eagle3 command in ``text``; a line ending in ``\\``
    continues on the next, and an inline-code span may span lines."""
    # a folded line break becomes \x01, so that line numbers still count it
    joined = re.sub(r"\\\n", " \x01", text)
    # inline code spans over several lines: fold the line break so the span reads as one line
    joined = re.sub(r"`[^`\n]*\n[^`\n]*`", lambda m: m.group(0).replace("\n", "\x01"), joined)
    starts = list(START.finditer(joined))
    for m, following in zip(starts, starts[1:] + [None]):
        tail = command_tail(joined[:following.start() if following else len(joined)], m.end())
        flags = flags_of(tail)
        before = joined[:m.start()]
        yield before.count("\n") + before.count("\x01") + 1, m.group(1), flags


def test_commands_in_finds_flags_across_continuations_and_lists():
    text = ('eagle3 train --store s \\\n  --model m   # --data here is a comment\n'
            'run(["eagle3", "eval", "-m", x, "--prompts", p])\n'
            'see `eagle3 gen-data -m M\n--dataset d` and `--data` elsewhere\n'
            '-m eagle3cli.cli quickstart [--max-steps 3 | --max-samples 4] | tee log\n'
            '"""eagle3 train with each choice at --lr; then eagle3 recipes (eagle3 eval --prompts p)"""\n')
    assert list(commands_in(text)) == [(1, "train", ["--store", "--model"]), (3, "eval", ["-m", "--prompts"]),
                                       (4, "gen-data", ["-m", "--dataset"]),
                                       (6, "quickstart", ["--max-steps", "--max-samples"]),
                                       (7, "train", []), (7, "recipes", []), (7, "eval", ["--prompts"])]


def test_every_shown_command_uses_current_flags():
    known = visible_flags()
    assert known["train"] >= {"--store", "--prompts"} and "--data" not in known["train"]
    bad = []
    for rel in SCANNED:
        path = ROOT / rel
        if not path.exists():
            continue
        for line, command, flags in commands_in(path.read_text(errors="replace")):
            bad += [f"{rel}:{line}: eagle3 {command} {f}" for f in flags if f not in known[command]]
    assert not bad, "flags that eagle3 <command> --help does not show (old spelling or none):\n" + "\n".join(bad)
