"""SGLang releases as systems under test: which release (and which planted patch of it) a
matrix column is, where its pinned venv lives, and the throwaway patched copies."""

from canaries.releases.patches import SGLangPatch, patch_catalogue, patched_interpreter
from canaries.releases.spec import ReleaseError, ReleaseSpec, parse_releases
from canaries.releases.venvs import release_python

__all__ = ["ReleaseError", "ReleaseSpec", "SGLangPatch", "parse_releases", "patch_catalogue",
           "patched_interpreter", "release_python"]
