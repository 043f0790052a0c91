"""The docs cite their results by path: every ``bench/results/...`` file that README.md, bench/README.md
(where it is ``results/...``) or docs/*.md name exists, and every file in bench/results/ is cited (a
result nothing cites goes; its history stays in git)."""
import glob
import os
import re

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
RESULTS = os.path.join(ROOT, "bench", "results")
# a cited result: results/<benchmark>/<file> (from the repository root with bench/ before it)
CITED = re.compile(r"(?<![\w/])(?:bench/)?results/([A-Za-z0-9_]+/[A-Za-z0-9_.-]*[A-Za-z0-9_])")


def _docs():
    return [os.path.join(ROOT, "README.md"), os.path.join(ROOT, "bench", "README.md"),
            *sorted(glob.glob(os.path.join(ROOT, "docs", "*.md")))]


def _cited():
    cited = {}
    for doc in _docs():
        with open(doc) as f:
            for number, line in enumerate(f, 1):
                for path in CITED.findall(line):
                    cited.setdefault(path, f"{os.path.relpath(doc, ROOT)}:{number}")
    return cited


def test_every_cited_result_exists():
    cited = _cited()
    assert cited, "the docs cite no bench/results file: has the citation form changed?"
    missing = [f"{where}: bench/results/{path}" for path, where in sorted(cited.items())
               if not os.path.isfile(os.path.join(RESULTS, path))]
    assert not missing, "cited results that do not exist:\n" + "\n".join(missing)


def test_every_result_is_cited():
    files = {os.path.relpath(p, RESULTS) for p in glob.glob(os.path.join(RESULTS, "**", "*"), recursive=True)
             if os.path.isfile(p)}
    uncited = sorted(files - set(_cited()))
    assert not uncited, "files in bench/results/ no doc cites (cite them or delete them):\n" + "\n".join(uncited)
