"""A world of one that saves to the paths it is given (argv[2:-1]) and writes, per path, "saved" or
the error it got, as JSON to argv[-1]; argv[1] is its run directory."""

import json
import sys

import torch

from phalanx import Phalanx

if __name__ == "__main__":
    px = Phalanx(run_dir=sys.argv[1], watchdog_timeout=0)
    model = torch.nn.Linear(3, 1)
    model, optimizer = px.prepare(model, torch.optim.AdamW(model.parameters()))
    px.backward(model(torch.ones(2, 3)).sum())
    optimizer.step()
    results = {}
    for path in sys.argv[2:-1]:
        try:
            px.save_state(path)
            results[path] = "saved"
        except BaseException as error:  # noqa: BLE001 - DCP's CheckpointException is a BaseException
            results[path] = f"{type(error).__name__}: {error}"
    with open(sys.argv[-1], "w") as fp:
        json.dump(results, fp)
