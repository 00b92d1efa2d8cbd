"""SGLang releases as systems under test: which SGLang a matrix column is (a release on the
index, a wheel, a source checkout, with planted patches and diffs), where its venv lives, and
the throwaway patched copies."""

from canaries.sglang.releases.errors import ReleaseError
from canaries.sglang.releases.patches import (
    SGLangPatch,
    patch_catalogue,
    patch_mirror,
    patched_interpreter,
)
from canaries.sglang.releases.source import SGLangSource
from canaries.sglang.releases.spec import ReleaseSpec, match_release, parse_releases
from canaries.sglang.releases.venvs import release_python

__all__ = ["ReleaseError", "ReleaseSpec", "SGLangPatch", "SGLangSource", "match_release", "parse_releases",
           "patch_catalogue", "patch_mirror", "patched_interpreter", "release_python"]
