"""The documentation a newcomer reads names only what exists, stays short, and names revisions only where they
name the run: README.md, docs/*.md (not the lab log, docs/log/), results/<preset>/README.md and the notebooks.
Each check is a function of the text, so a test feeds it a bad text and sees it fail."""
import json
import re
from pathlib import Path

import pytest

from xpress import paths

ROOT = paths.REPO_ROOT
LIMITS = {"README.md": 12_000, "docs/inference.md": 16_000, "docs/training.md": 16_000}
HASHES = {"README.md": 3}  # commit hashes a reference text may hold; every other reference doc: DOC_HASHES
DOC_HASHES = 2
RESULT_PATH = re.compile(r"results/(?:cpu|h200)/[A-Za-z0-9_.{},/*<>-]*[A-Za-z0-9_}>*/]")
FIGURE = re.compile(r"(?:results/[a-z0-9-]+/)?figures/[A-Za-z0-9_.-]+\.(?:png|pdf|svg)")
IMAGE = re.compile(r"!\[[^\]]*\]\(([^)\s]+)\)")
HASH = re.compile(r"(?<![\w.])(?=[0-9a-f]*[a-f])(?=[0-9a-f]*[0-9])[0-9a-f]{7,40}(?![\w])")


def reference_texts() -> dict[str, str]:
    """What the reading path holds: README.md, docs/*.md (the log apart), results/<preset>/README.md, and the
    source of every notebook cell (outputs are the run's, not prose)."""
    files = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), *sorted((ROOT / "results").glob("*/README.md"))]
    texts = {str(f.relative_to(ROOT)): f.read_text() for f in files}
    for nb in sorted((ROOT / "notebooks").glob("*.ipynb")):
        cells = json.loads(nb.read_text())["cells"]
        texts[str(nb.relative_to(ROOT))] = "\n".join("".join(c["source"]) for c in cells)
    return texts


def _expand(path: str) -> list[str]:
    """``results/cpu/x.{json,csv}`` -> both names."""
    m = re.search(r"\{([^{}]+)\}", path)
    if not m:
        return [path]
    return [p for alt in m.group(1).split(",") for p in _expand(path[:m.start()] + alt + path[m.end():])]


def missing_result_paths(text: str, root: Path = ROOT) -> list[str]:
    """The ``results/cpu/...`` and ``results/h200/...`` paths ``text`` names that do not exist under ``root``;
    templates (``<preset>``, ``*``) and paths the text itself says are absent (``PATH: not found``, as
    ``gpu-hours`` lists what it looked for) are exempt."""
    out = []
    text = re.sub(r"results/\S+: not found", "", text)
    for p in RESULT_PATH.findall(text):
        if any(c in p for c in "<>*"):
            continue
        out += [q for q in _expand(p.rstrip(".")) if not (root / q).exists()]
    return out


def missing_figures(text: str, base: Path, root: Path = ROOT) -> list[str]:
    """Figure files ``text`` names (``figures/<name>.png`` of the cpu preset unless a path says otherwise, and
    every image link, relative to ``base``, the text's folder) that do not exist."""
    out = []
    for f in FIGURE.findall(text):
        path = root / f if f.startswith("results/") else root / "results" / "cpu" / f
        if not path.exists():
            out.append(f)
    for link in IMAGE.findall(text):
        if not link.startswith("http") and not (base / link).exists() and link not in out:
            out.append(link)
    return out


def commit_hashes(text: str) -> list[str]:
    """Words of 7-40 hex digits with a letter and a digit among them: commit hashes."""
    return HASH.findall(text)


def test_every_results_path_the_reading_path_names_exists():
    bad = {name: missing_result_paths(text) for name, text in reference_texts().items()}
    assert not {k: v for k, v in bad.items() if v}, f"paths named but not in the repository: {bad}"


def test_every_figure_the_docs_name_exists():
    bad = {name: missing_figures(text, (ROOT / name).parent) for name, text in reference_texts().items()}
    assert not {k: v for k, v in bad.items() if v}, f"figures named but not in the repository: {bad}"


def test_readme_and_reference_docs_fit_their_length():
    for name, limit in LIMITS.items():
        n = len((ROOT / name).read_text())
        assert n <= limit, f"{name} is {n:,} characters, over {limit:,}: move detail to docs/ or the log"


def test_the_result_is_stated_on_the_first_screen():
    assert "In one sentence" in (ROOT / "README.md").read_text()[:4000]


def test_revisions_appear_only_where_they_name_the_run():
    for name, text in reference_texts().items():
        if not name.endswith(".md") or name.startswith("results/"):
            continue  # notebooks cite no revision by hand; results/<preset>/README.md is provenance
        found = commit_hashes(text)
        assert len(found) <= HASHES.get(name, DOC_HASHES), f"{name} names commits {found}: keep them in docs/log/"


def test_generated_sections_agree_with_the_result_files():
    from xpress import report

    for preset in ("cpu", "cpu-math", "qwen3-8b"):
        assert report.stale(preset) == [], f"run `python -m xpress report --preset {preset}`"


def test_license_and_citation_are_present():
    assert "MIT License" in (ROOT / "LICENSE").read_text() and "The xpress authors" in (ROOT / "LICENSE").read_text()
    assert "cff-version" in (ROOT / "CITATION.cff").read_text()
    assert "@article" in (ROOT / "README.md").read_text() and "2608.02438" in (ROOT / "README.md").read_text()


def unlisted_archive_folders(index: str, folders: list[Path]) -> list[str]:
    """The folders (relative to results/archive/) that the archive's index does not name: by their path, by
    their name, as ``<study>-<revision>`` with the revision listed, or (``runN``) through their parent."""
    def listed(f: Path) -> bool:
        if f"{f.as_posix()}/" in index or f"`{f.name}/`" in index:
            return True
        if re.fullmatch(r"run\d+", f.name):
            return listed(f.parent)
        m = re.fullmatch(r"(.+)-([0-9a-f]{7})", f.name)
        return bool(m) and f"{f.parent.as_posix()}/{m.group(1)}-<revision>" in index and f"`{m.group(2)}`" in index
    return [f.as_posix() for f in folders if not listed(f)]


def test_the_archive_index_lists_every_archived_folder():
    archive = ROOT / "results" / "archive"
    folders = sorted({p.parent.relative_to(archive) for p in archive.rglob("*") if p.is_file() and p.parent != archive})
    assert folders and not unlisted_archive_folders((archive / "README.md").read_text(), folders)


# The checks above must be able to fail: each is fed a text that breaks it.

def test_the_checks_catch_what_they_are_for(tmp_path):
    (tmp_path / "results" / "cpu" / "figures").mkdir(parents=True)
    (tmp_path / "results" / "cpu" / "table1.json").write_text("{}")
    (tmp_path / "results" / "cpu" / "figures" / "a.png").write_text("")
    text = ("`results/cpu/table1.json`, `results/cpu/gone.json`, `results/cpu/table1.{json,csv}`, "
            "`results/<preset>/run.json`, results/h200/latency.json.")
    assert missing_result_paths(text, tmp_path) == ["results/cpu/gone.json", "results/cpu/table1.csv",
                                                    "results/h200/latency.json"]
    assert missing_figures("`figures/a.png`, `figures/b.png`, ![x](results/cpu/figures/c.png)", tmp_path,
                           tmp_path) == ["figures/b.png", "results/cpu/figures/c.png"]
    assert commit_hashes("at git 9093b7a, reproduce-d21947f/, 1,500 steps, 2026-12-05, deadbeef, cafe") == [
        "9093b7a", "d21947f"]
    assert not commit_hashes("results/cpu/table1.json and 0x1f2e3d4c and the word feedback")
    index = "`cpu/a/`; `cpu/a/table1-<revision>/` (`1c9d543`); `cpu/b/reproduce-2e217bd/`, `oracle_ceiling-2e217bd/`"
    folders = [Path(p) for p in ("cpu/a", "cpu/a/table1-1c9d543/run1", "cpu/a/table1-0645bf4", "cpu/b/oracle_ceiling-2e217bd",
                                 "cpu/b/reproduce-2e217bd", "cpu/c")]
    assert unlisted_archive_folders(index, folders) == ["cpu/a/table1-0645bf4", "cpu/c"]


def test_a_stale_generated_section_is_caught(monkeypatch):
    from xpress import report

    text = (ROOT / "README.md").read_text()
    begin, end = report._markers("cpu", "glance")
    assert begin in text, "README.md lost its generated result at a glance"
    head, rest = text.split(begin, 1)
    body, tail = rest.split(end, 1)
    tampered = f"{head}{begin}{body.replace('1.0', '1.9', 1)}{end}{tail}"
    assert tampered != text and report.render("cpu", tampered) == text


@pytest.mark.parametrize("name", sorted(LIMITS))
def test_length_limits_name_real_files(name):
    assert (ROOT / name).is_file()
