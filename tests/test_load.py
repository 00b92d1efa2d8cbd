"""A short, bounded run of the load test: whole answers, the oracle's tokens, a healthy engine."""

from __future__ import annotations

from pathlib import Path

import pytest

from canaries.load import LoadConfig, run_load


@pytest.mark.slow
def test_concurrent_mixed_load_with_hang_ups_gets_whole_oracle_answers(tmp_path: Path) -> None:
    result = run_load(LoadConfig(clients=16, duration_s=6, disconnect_fraction=0.2, seed=5), tmp_path)
    print(result.summary())
    assert len(result.answered) >= 20, "too little traffic to mean anything"
    assert any(s.hang_up_after_s is not None for s in result.sent)
    assert result.truncated == [] and result.mismatched == [] and result.errors == []
    assert result.engine_problems == []
    # Clients that hung up before their answer had their requests aborted by the engine (one
    # whose answer was already on its way when it left is not, hence at most).
    hung_up = [s for s in result.sent if s.hang_up_after_s is not None and s.status is None]
    assert 0 < result.engine_state["stats"]["aborted_requests"] <= len(hung_up)


def test_load_config_rejects_a_bad_fraction() -> None:
    with pytest.raises(ValueError, match="disconnect_fraction"):
        LoadConfig(disconnect_fraction=1.5)
