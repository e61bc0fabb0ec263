"""Write the embedded default model (Gemma 3 270M Q4_K_M) into the cache and print its path.

The same as the ``pyimp-fetch-model`` console script (pyimp/cli/fetch_model.py).
"""
import sys

from pyimp.cli.fetch_model import main

if __name__ == "__main__":
    sys.exit(main())
