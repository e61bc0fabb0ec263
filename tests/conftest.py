import os
import sys

# tools/ holds oracle bindings and fixture fetchers shared by tests and scripts.
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)
