"""The test suite mirrors the package: tests/<wing>/test_*.py tests eagle3cli/<wing>/ (core, config,
model, engines, decode, data, publish, train, evaluate, workflows). Beside the wings:

- cli/: the command line as a whole (eagle3cli/cli.py, cli_docs.py and commands/): flag names,
  --help, the commands the docs print;
- repo/: the repository as a whole: the package's import structure, docs references, benchmark
  scripts and this layout;
- helpers/: what several test modules share (tiny targets, fake engines, draft and store builders);
- fixtures/: data files (tokenizers, chat templates, engine name lists).

Fixtures used everywhere live in conftest.py; a test module imports from helpers/, never from
another test module (tests/repo/test_layout.py enforces both rules).
"""
