"""Entry point of one rank started by tests.dist.harness: call the target, save its result."""

import importlib
import os
import sys
from pathlib import Path

import torch


def main() -> None:
    target, out = sys.argv[1], Path(sys.argv[2])
    module_name, func_name = target.split(":")
    func = getattr(importlib.import_module(module_name), func_name)
    args = torch.load(out / "args.pt", weights_only=False)
    result = func(*args)
    torch.save(result, out / f"result{os.environ['RANK']}.pt")


if __name__ == "__main__":
    main()
