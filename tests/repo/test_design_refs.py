"""Every ``docs/design.md §N`` reference in the package, docs, tests and benchmarks names a
section that exists, and no reference points at the old out-of-repository design note."""

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
DESIGN = ROOT / "docs" / "design.md"
SCANNED = ["eagle3cli", "docs", "tests", "benchmarks", "README.md", "CHANGELOG.md"]
SUFFIXES = {".py", ".md", ".sh", ".yaml", ".jinja", ".toml"}
OLD_NOTE = "DESIGN" + ".md"  # spelled in two halves so this file does not match itself
# "docs/design.md §3", "docs/design.md §3-§5", "docs/design.md §2, §4 and §6"
REFERENCE = re.compile(r"docs/design\.md((?:\s*(?:,|-|–|and|to)?\s*§\d+)+)")
SECTION = re.compile(r"^## (\d+)\. \S", re.M)


def scanned_files() -> list[Path]:
    out = []
    for name in SCANNED:
        p = ROOT / name
        if p.is_file():
            out.append(p)
        elif p.is_dir():
            out.extend(f for f in sorted(p.rglob("*")) if f.is_file() and f.suffix in SUFFIXES
                       and "__pycache__" not in f.parts)
    return out


def sections() -> set[int]:
    return {int(n) for n in SECTION.findall(DESIGN.read_text())}


def references(text: str) -> list[int]:
    return [int(n) for m in REFERENCE.finditer(text) for n in re.findall(r"§(\d+)", m.group(1))]


def test_design_sections_are_numbered_in_order():
    found = [int(n) for n in SECTION.findall(DESIGN.read_text())]
    assert found == list(range(1, len(found) + 1)), found
    assert len(found) >= 10  # layers, draft, vocab, config, TTT, decoding, metrics, store, results, facts


def test_every_design_reference_names_an_existing_section():
    have = sections()
    bad, count = [], 0
    for f in scanned_files():
        for lineno, line in enumerate(f.read_text(errors="replace").splitlines(), 1):
            for n in references(line):
                count += 1
                if n not in have:
                    bad.append(f"{f.relative_to(ROOT)}:{lineno}: docs/design.md §{n} (sections: 1-{max(have)})")
    assert not bad, "references to missing sections:\n" + "\n".join(bad)
    assert count >= 15  # the package really points here


def test_no_reference_to_the_old_design_note():
    bad = [f"{f.relative_to(ROOT)}:{i}: {line.strip()}" for f in scanned_files()
           for i, line in enumerate(f.read_text(errors="replace").splitlines(), 1) if OLD_NOTE in line]
    assert not bad, f"bare {OLD_NOTE} references (use docs/design.md §N):\n" + "\n".join(bad)


def test_referenced_docs_files_exist():
    bad = []
    for f in scanned_files():
        for m in re.finditer(r"\bdocs/([\w.-]+\.md)\b", f.read_text(errors="replace")):
            if not (ROOT / "docs" / m.group(1)).exists():
                bad.append(f"{f.relative_to(ROOT)}: docs/{m.group(1)}")
    assert not bad, "references to missing docs files:\n" + "\n".join(bad)


def test_reference_parser():
    assert references("see docs/design.md §3-§5 and more") == [3, 5]
    assert references("(docs/design.md §2, §4 and §6)") == [2, 4, 6]
    assert references("docs/design.md §10.") == [10]
    assert references("design.md 4") == []
