"""Worker script: rank 0 prints the addresses listening on the store's port (MASTER_PORT)."""
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from listeners import listening_addresses  # noqa: E402

if os.environ["RANK"] == "0":
    print("LISTENERS", os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"],
          ",".join(listening_addresses(int(os.environ["MASTER_PORT"]))))
