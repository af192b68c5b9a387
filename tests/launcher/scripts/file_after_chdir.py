"""Reads a file next to itself by `os.path.dirname(__file__)` after changing directory, as
`python script.py` allows (its `__file__` is absolute)."""

import json
import os
import sys

here = os.path.dirname(__file__)
os.chdir(sys.argv[1])
with open(os.path.join(here, "file_after_chdir.py")) as f:
    first = f.readline().strip()
with open(f"rank{os.environ['RANK']}.json", "w") as f:
    json.dump({"file": __file__, "first": first}, f)
