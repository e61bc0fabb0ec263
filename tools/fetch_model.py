"""Write the embedded default model (Gemma 3 270M Q4_K_M) into the cache and print its path."""
import sys

from pyimp.default_model import DefaultModelError, default_model_path


def main() -> int:
    try:
        print(default_model_path())
    except DefaultModelError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
