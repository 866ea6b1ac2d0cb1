"""The standalone data producer of disaggregated preprocessing, on a CPU host of its own:

    python -m disttrain_core.launch.producer --listen 10.0.0.5:7070 --key file:/secrets/key [overrides]

It composes and validates the trainers' config (the same overrides as train.py), then serves its global batches
(data/producer.py) to trainers started with ``data.producer.address=HOST:PORT``."""

from __future__ import annotations

import argparse
import os
import sys

from ..base.net import split_address
from ..data.producer import run_server
from ..data.transport import load_key


def _checked_config(overrides: list[str]):
    """The composed, typed and validated config; raises ConfigError with one line."""
    from ..config import compose, typed_config
    from ..launch.cli import describe_compose_error
    from ..planner.fit import validate_run
    from ..validation import ConfigError

    try:
        cfg = typed_config(compose(overrides))
    except Exception as error:  # Hydra/OmegaConf: an unknown key, a bad value type, a missing option
        raise ConfigError(describe_compose_error(error, overrides)) from None
    validate_run(cfg)
    return cfg


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--listen", default="127.0.0.1:7070", help="HOST:PORT to bind (default 127.0.0.1:7070)")
    parser.add_argument("--key", default=None, help="hex:<hex>, file:<path>; default $DISTTRAIN_PRODUCER_KEY")
    parser.add_argument("overrides", nargs="*", help="config overrides, as for train.py (model, data, ...)")
    args = parser.parse_args(argv)
    from ..validation import ConfigError

    try:
        split_address(args.listen)
    except ValueError:
        print(f"error: --listen {args.listen!r}: use HOST:PORT, e.g. 127.0.0.1:7070", file=sys.stderr)
        return 2
    try:
        cfg = _checked_config(args.overrides)
    except ConfigError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    key = args.key or os.environ.get("DISTTRAIN_PRODUCER_KEY")
    if not key:
        print("error: give --key (hex:... or file:...) or set DISTTRAIN_PRODUCER_KEY", file=sys.stderr)
        return 2
    try:
        secret = load_key(key)
    except (OSError, ValueError) as error:
        print(f"error: the producer key: {error}", file=sys.stderr)
        return 2
    run_server(cfg, secret, args.listen)
    return 0


if __name__ == "__main__":
    sys.exit(main())
