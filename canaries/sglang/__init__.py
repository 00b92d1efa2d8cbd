"""Everything of the suite that faces SGLang, the second system under test.

`releases/` (a candidate's venv, its version and provenance, planted patches and diffs), `server/`
(SGLang's real server: its launch, the model it loads, the reference answers it is held to, and
the code the suite loads into SGLang's own processes: the scheduler plugin, the census, the hook
sites, the stand-ins), `runtime.py` (`--runtime sglang-server`), `parity.py`, `divergences.py`,
`matrix.py` and `matrix_html.py` (our engine against SGLang's memory path and server, release by
release, and the pre-release gate). The engine under test is `engine_stub`; the harness that drives
either is the rest of `canaries`.

Nothing here imports `sglang` at module level: only the code loaded into SGLang's processes, and
the memory-path adapters under engine_stub/mem/, do, and only when chosen.
"""
