"""The docs: the generated configuration reference is current, the MkDocs site builds with no
warning, and README.md stays short with every relative link resolving."""
import pathlib
import re
import subprocess
import sys

from levanter_flax.config import reference

REPO = pathlib.Path(__file__).resolve().parents[1]


def test_the_configuration_reference_is_current():
  page = REPO / "docs" / "configuration-reference.md"
  assert page.read_text() == reference.markdown(), (
      f"{page.relative_to(REPO)} is stale: run `{reference.COMMAND}` and commit the page")


def test_the_site_builds_strict(tmp_path):
  result = subprocess.run(
      [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path / "site")],
      cwd=REPO, capture_output=True, text=True, timeout=300)
  assert result.returncode == 0, result.stdout + result.stderr


def test_the_readme_is_short_and_its_links_resolve():
  readme = REPO / "README.md"
  assert len(readme.read_bytes()) <= 12_000
  links = re.findall(r"\]\(([^)\s]+)\)", readme.read_text())
  local = [link.split("#", 1)[0] for link in links if not re.match(r"[a-z]+:", link)]
  assert local
  missing = [link for link in local if link and not (REPO / link).exists()]
  assert not missing, f"README.md links to missing files: {missing}"
