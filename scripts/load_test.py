"""Load test one local engine: concurrent clients on mixed endpoints, long and short prompts,
clients that hang up; then every answer checked (whole, equal to the oracle) and the engine's
health. Exits 1 on a truncated answer, an oracle mismatch, an error or an unhealthy engine.

    python scripts/load_test.py                       # 64 clients for 60 s
    python scripts/load_test.py --clients 16 --duration 10
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from canaries.load import LoadConfig, run_load  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--clients", type=int, default=64)
    parser.add_argument("--duration", type=float, default=60.0, help="seconds of new requests")
    parser.add_argument("--disconnect-fraction", type=float, default=0.1)
    parser.add_argument("--max-new-tokens", type=int, default=48)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--run-dir", default=None, help="engine log and events (default: a temp dir)")
    args = parser.parse_args()
    try:
        config = LoadConfig(clients=args.clients, duration_s=args.duration,
                            disconnect_fraction=args.disconnect_fraction,
                            max_new_tokens=args.max_new_tokens, seed=args.seed)
    except ValueError as exc:
        parser.error(str(exc))
    result = run_load(config, args.run_dir)
    print(result.summary())
    return 0 if result.ok else 1


if __name__ == "__main__":
    sys.exit(main())
