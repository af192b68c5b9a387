"""Whole-tensor optimizers (torch's Muon and Adafactor, a user-written trust ratio) trained through
`px.forward_backward` in any layout, with a one-process reference computed in rank 0 on the same
global batches; Newton-Schulz calls counted in every rank."""

from __future__ import annotations

import copy
import warnings
from typing import Any

import torch
import torch.optim._muon as torch_muon
from torch import nn
from torch.utils.data import DataLoader

from phalanx import Phalanx
from tests.dist.tp_workloads import TINY_LM_PLAN, TinyLM, lm_loss, make_data

NS_CALLS = [0]  # Newton-Schulz runs in this process
_newton_schulz = torch_muon._zeropower_via_newtonschulz


def _counted_newton_schulz(*args: Any, **kwargs: Any) -> torch.Tensor:
    NS_CALLS[0] += 1
    return _newton_schulz(*args, **kwargs)


torch_muon._zeropower_via_newtonschulz = _counted_newton_schulz  # Muon's step looks the name up per call


class TrustRatioSGD(torch.optim.Optimizer):
    """A user's LAMB-like optimizer: momentum SGD whose step is scaled by ||w|| / ||update||, a
    whole-tensor norm (on a slice it would be the slice's). Declares nothing: phalanx must warn."""

    def __init__(self, params: Any, lr: float = 1e-2, momentum: float = 0.9):
        super().__init__(params, {"lr": lr, "momentum": momentum})

    @torch.no_grad()
    def step(self, closure: Any = None) -> None:
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if "momentum_buffer" not in state:
                    state["momentum_buffer"] = torch.zeros_like(p)
                buf = state["momentum_buffer"]
                buf.mul_(group["momentum"]).add_(p.grad)
                w, u = p.norm(), buf.norm()
                ratio = torch.where((w > 0) & (u > 0), w / u.clamp_min(1e-12), torch.ones_like(w))
                p.sub_(buf * (group["lr"] * ratio))


def make_model() -> TinyLM:
    torch.manual_seed(0)
    return TinyLM(2)


def make_optimizers(model: nn.Module, which: str) -> list[torch.optim.Optimizer]:
    """As a user builds them: Muon on the blocks' matrices with AdamW on the rest (embedding, head,
    norms, biases), or one Adafactor / trust-ratio optimizer over everything."""
    if which == "muon":
        matrices = [p for n, p in model.named_parameters() if n.startswith("layers.") and p.dim() == 2]
        chosen = {id(p) for p in matrices}
        rest = [p for p in model.parameters() if id(p) not in chosen]
        return [torch.optim.Muon(matrices, lr=0.02), torch.optim.AdamW(rest, lr=1e-2)]
    if which == "adafactor":
        return [torch.optim.Adafactor(model.parameters(), lr=1e-2)]
    if which == "trust":
        return [TrustRatioSGD(model.parameters(), lr=1e-2)]
    if which == "lbfgs":
        return [torch.optim.LBFGS(model.parameters())]
    raise ValueError(which)


def num_matrices(which: str) -> int:
    return (
        len([n for n, p in make_model().named_parameters() if n.startswith("layers.") and p.dim() == 2])
        if which == "muon"
        else 0
    )


def _edit(model: nn.Module) -> None:
    """Weights changed by hand between steps (what an owner's whole copy must notice)."""
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(0.9)


def reference(which: str, global_batch: int, steps: int, edit_at: int | None = None) -> dict[str, Any]:
    model = make_model()
    optimizers = make_optimizers(model, which)
    batches = iter(DataLoader(make_data(), batch_size=global_batch))
    losses = []
    for _ in range(steps):
        (batch,) = next(batches)
        loss = lm_loss(model(batch[:, :-1]), batch[:, 1:])
        loss.backward()
        for optimizer in optimizers:
            optimizer.step()
            optimizer.zero_grad()
        losses.append(loss.item())
        if len(losses) == edit_at:
            _edit(model)
    return {"losses": losses, "state": {k: v.detach().clone() for k, v in model.state_dict().items()}}


def train(
    which: str,
    steps: int = 6,
    global_batch: int = 8,
    checkpoint: str | None = None,
    resume: str | None = None,
    edit_at: int | None = None,
    **settings: Any,
) -> dict[str, Any]:
    """`steps` steps of `which` in the layout `settings` describe (a resume first restores
    `resume`); rank 0 also returns the one-process reference over the same batches from the start."""
    if settings.get("tp", 1) > 1:
        settings.setdefault("tp_plan", TINY_LM_PLAN)
    px = Phalanx(**settings)
    model = make_model()
    optimizers = make_optimizers(model, which)
    loader = DataLoader(make_data(), batch_size=global_batch // px.dp_size)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model, *optimizers, loader = px.prepare(model, *optimizers, loader)
    done = 0
    if resume is not None:
        assert px.load_state(resume)
        done = px.global_step
    NS_CALLS[0] = 0
    losses = []
    for (batch,) in loader:
        loss = px.forward_backward(model, batch[:, :-1], batch[:, 1:], lm_loss)
        for optimizer in optimizers:
            optimizer.step()
            optimizer.zero_grad()
        losses.append(px.reduce(loss, "mean").item())
        if len(losses) == edit_at:
            _edit(model)
        if len(losses) == steps:
            ns_calls = NS_CALLS[0]
            if checkpoint is not None:
                px.save_state(checkpoint)  # inside the epoch: a resume goes on with its next batch
            break
    else:
        ns_calls = NS_CALLS[0]
    out = {
        "plan": px.plan.describe(),
        "losses": losses,
        "ns_calls": ns_calls,
        "steps": len(losses),
        "warnings": [str(w.message) for w in caught],
        "kinds": [type(getattr(o, "optimizer", o)).__name__ for o in optimizers],
        "state": {k: v.detach().clone().float() for k, v in px.get_state_dict(model).items()},
    }
    if px.rank == 0:
        out["reference"] = reference(which, global_batch, done + len(losses), edit_at)
    return out


def matrix(cases: dict[str, dict]) -> dict[str, dict]:
    """Every case in order in this rank: one process group serves them all."""
    out = {}
    for name, kwargs in cases.items():
        try:
            out[name] = train(**copy.deepcopy(kwargs))
        except ValueError as error:  # a refusal before training: the test reads the message
            out[name] = {"refused": str(error)}
    return out


def checkpoint_chain(zero3_dir: str, zero1_dir: str) -> dict[str, dict]:
    """Muon: 3 steps under zero3, saved, resumed under ddp and under zero2 (each owner takes its
    matrices' state) for 3 more; Adafactor: 3 steps under zero1, saved, resumed under zero3 (a one-process
    run resumes it too)."""
    return {
        "muon zero3 saved": train("muon", 3, checkpoint=zero3_dir, strategy="zero3"),
        "muon ddp resumed": train("muon", 3, resume=zero3_dir, strategy="ddp"),
        "muon zero2 resumed": train("muon", 3, resume=zero3_dir, strategy="zero2"),
        "adafactor zero1 saved": train("adafactor", 3, checkpoint=zero1_dir, strategy="zero1"),
        "adafactor zero3 resumed": train("adafactor", 3, resume=zero1_dir, strategy="zero3"),
    }


def uneven_join(method: str = "join") -> dict[str, Any]:
    """zero1 + Muon (matrices owned by both ranks) over rank-dependent batch counts inside
    px.uneven_inputs: a rank out of data still takes part in the owners' broadcasts."""
    px = Phalanx(strategy="zero1")
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8, bias=False), nn.Linear(8, 8, bias=False), nn.Linear(8, 1, bias=False))
    model, muon = px.prepare(model, torch.optim.Muon(model.parameters(), lr=0.02))
    g = torch.Generator().manual_seed(px.rank)
    batches = [torch.randn(4, 8, generator=g) for _ in range(4 - px.rank)]
    steps = 0
    with px.uneven_inputs(model, muon, method=method) as uneven:
        for x in uneven.iter(batches):
            px.backward(model(x).pow(2).mean())
            muon.step()
            muon.zero_grad()
            steps += 1
    px.wait_for_everyone()
    return {"steps": steps, "method": uneven.method, "params": [p.detach().clone() for p in model.parameters()]}
