"""The user documentation points at things that exist inside the repository: every relative link of
README.md, BENCHMARKS.md, CHANGELOG.md and docs/**/*.md resolves to a file of the checkout (the file,
and the heading of an anchor into Markdown; a link that leaves the checkout, as ``../shared/...``
would, is broken for every reader of the repository even where it exists here), every Markdown path
named in their prose (a spec such as ``docs/ACCO.md``) is one of the checkout's, and every checkout
path the current docs name in backticks exists (a moved module or test would otherwise leave them
pointing at nothing). The run folders' READMEs keep the code paths of the commit they name, so their
backticked code paths are not checked."""
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
NEEDS_DEEPSPEED_OPS = False
CURRENT = [ROOT / "README.md", ROOT / "BENCHMARKS.md", *sorted((ROOT / "docs").glob("*.md"))]
LINKED = [ROOT / "README.md", ROOT / "BENCHMARKS.md", ROOT / "CHANGELOG.md", *sorted((ROOT / "docs").rglob("*.md"))]
_LINK = re.compile(r"\]\(([^)\s]+)\)")
_LINKED_TEXT = re.compile(r"\[[^\]]*\]\([^)\s]+\)")
# a Markdown file named by a path with a folder in prose: ``docs/ACCO.md``, ``../BENCHMARKS.md``
_MD_PATH = re.compile(r"(?<![\w./-])((?:\.\./|\.?[\w-][\w.-]*/)+[\w.-]+\.md)\b")
_CODE_PATH = re.compile(r"`((?:ds_acco|benchmarks|tests|scripts|examples|docs)/[\w./-]*)`")
_FENCE = re.compile(r"```.*?```", flags=re.S)


def slug(heading: str) -> str:
    """GitHub's anchor for a Markdown heading: lower case, punctuation but '-' and '_' dropped."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower().replace("`", "")).replace(" ", "-")


def broken_links(files, root: Path = ROOT) -> list:
    """``file: target (why)`` for each relative link of ``files`` that leads nowhere."""
    out = []
    for f in files:
        for target in _LINK.findall(_FENCE.sub("", f.read_text())):
            if re.match(r"^[a-z]+:", target):
                continue  # http(s), mailto
            path, _, anchor = target.partition("#")
            dest = (f.parent / path).resolve() if path else f
            if not dest.is_relative_to(root.resolve()):
                out.append(f"{f.relative_to(root)}: {target} (outside the repository)")
            elif not dest.exists():
                out.append(f"{f.relative_to(root)}: {target} (no such file)")
            elif anchor and dest.suffix == ".md":
                headings = re.findall(r"^#+\s+(.*)$", _FENCE.sub("", dest.read_text()), flags=re.M)
                if anchor not in {slug(h) for h in headings}:
                    out.append(f"{f.relative_to(root)}: {target} (no such heading)")
    return out


def dangling_md_paths(files, root: Path = ROOT) -> list:
    """``file: path`` for each Markdown path with a folder named in prose (outside links and code
    blocks) that is no file of the repository, from the file's folder or from the root."""
    out = []
    for f in files:
        for path in _MD_PATH.findall(_LINKED_TEXT.sub("", _FENCE.sub("", f.read_text()))):
            found = [d for d in ((f.parent / path).resolve(), (root / path).resolve()) if d.is_file()]
            if not any(d.is_relative_to(root.resolve()) for d in found):
                out.append(f"{f.relative_to(root)}: {path}")
    return out


def missing_code_paths(files, root: Path = ROOT, checkout: Path = ROOT) -> list:
    """``file: `path``` for each checkout path named in backticks that does not exist."""
    out = []
    for f in files:
        for path in _CODE_PATH.findall(f.read_text()):
            if not (checkout / path.rstrip(".")).exists():
                out.append(f"{f.relative_to(root)}: `{path}`")
    return out


def test_every_docs_link_resolves():
    assert broken_links(LINKED) == []


def test_every_path_the_docs_name_exists():
    assert missing_code_paths(CURRENT) == []


def test_every_markdown_path_the_docs_name_is_in_the_repository():
    assert dangling_md_paths(LINKED) == []


def test_the_checks_find_a_broken_link_a_missing_heading_and_a_stale_path(tmp_path):
    a = tmp_path / "a.md"
    a.write_text("# The `x_y`: here\n[ok](#the-x_y-here) [gone](b.md) [no](a.md#nope) [web](https://x.y)\n"
                 "```\n[in code](nowhere.md)\n```\n")
    assert broken_links([a], tmp_path) == ["a.md: b.md (no such file)", "a.md: a.md#nope (no such heading)"]
    c = tmp_path / "c.md"
    c.write_text("see `benchmarks/runner.py` and `ds_acco/bench/runner.py`\n")
    assert missing_code_paths([c], tmp_path) == ["c.md: `ds_acco/bench/runner.py`"]


def test_the_checks_find_a_link_and_a_spec_path_outside_the_repository(tmp_path):
    repo, outside = tmp_path / "repo", tmp_path / "shared"
    (repo / "docs").mkdir(parents=True)
    outside.mkdir()
    (outside / "ACCO.md").write_text("# spec\n")
    (repo / "docs" / "ACCO.md").write_text("# ours\n")
    d = repo / "docs" / "d.md"
    d.write_text("[spec](../../shared/ACCO.md) [ours](ACCO.md) [up](../docs/ACCO.md)\n"
                 "as shared/ACCO.md says, and docs/ACCO.md, ../docs/ACCO.md and [docs/ACCO.md](ACCO.md)\n"
                 "see `../shared/ACCO.md` or ../../shared/ACCO.md\n")
    assert broken_links([d], repo) == ["docs/d.md: ../../shared/ACCO.md (outside the repository)"]
    assert dangling_md_paths([d], repo) == ["docs/d.md: shared/ACCO.md", "docs/d.md: ../shared/ACCO.md",
                                            "docs/d.md: ../../shared/ACCO.md"]


def test_the_readme_gets_out_of_the_way():
    # Issue 35: at most 250 lines, in this order; the reference material lives in docs/.
    text = (ROOT / "README.md").read_text()
    assert len(text.splitlines()) <= 250
    order = ["Install", "The two commands", "Migrating", "Results", "HF Trainer", "Accelerate", "Lightning",
             "Megatron-DeepSpeed", "FSDP2", "Documentation"]
    headings = re.findall(r"^## (.*)$", _FENCE.sub("", text), flags=re.M)
    assert [next((o for o in order if h.startswith(o)), h) for h in headings] == order
    assert "pip install ." in text and "accelerate launch --config_file" in text and "ACCELERATE_USE_CPU" in text
    assert len((ROOT / "BENCHMARKS.md").read_text().splitlines()) <= 200  # provenance goes to docs/bench/<run>/
