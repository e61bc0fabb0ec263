"""``pyimp-fetch-model``: write the embedded default model (Gemma 3 270M Q4_K_M) into the
cache, verified, and print its path; works from any folder once pyimp[gemma] is installed.

    llama-cli -m "$(pyimp-fetch-model)" -p "Hello"
"""
from __future__ import annotations

import argparse
import sys

PROG = "pyimp-fetch-model"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog=PROG, description=__doc__.split("\n\n")[0])
    p.parse_args(argv)
    from ..runtime.default_model import DefaultModelError, default_model_path
    try:
        path = default_model_path()
    except DefaultModelError as e:
        print(f"{PROG}: error: {e}", file=sys.stderr)
        return 1
    print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
