"""Workloads for pipeline parallelism (strategies/pipeline): a model of embedding + a ModuleList of
blocks + norm + head whose forward is a plain loop, trained on a (pp, dp) mesh and, in every rank,
side by side with one process training the whole model on the same global batch."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.device_mesh import init_device_mesh

from phalanx.loop.precision import Precision
from phalanx.strategies import pipeline as pipe
from tests.dist import pipeline_dp
from tests.dist.strategy_workloads import Block, make_optimizer

VOCAB, DIM, SEQ, GLOBAL_BATCH = 32, 16, 6, 8
LR, MAX_NORM = 1e-2, 0.5


class StackLM(nn.Module):
    def __init__(self, num_blocks: int = 4):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.layers = nn.ModuleList(Block(DIM) for _ in range(num_blocks))
        self.norm = nn.LayerNorm(DIM)
        self.head = nn.Linear(DIM, VOCAB)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        for layer in self.layers:
            x = layer(x)
        return self.head(self.norm(x))


def loss_fn(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten())


def new_model(num_blocks: int = 4) -> StackLM:
    torch.manual_seed(0)
    return StackLM(num_blocks)


def batch(step: int, size: int = GLOBAL_BATCH) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 + step)
    return torch.randint(0, VOCAB, (size, SEQ), generator=g), torch.randint(0, VOCAB, (size, SEQ), generator=g)


class Reference:
    """One process training the whole model on the global batches."""

    def __init__(self, num_blocks: int = 4) -> None:
        self.model = new_model(num_blocks)
        self.optimizer = make_optimizer(self.model, LR)

    def step(self, step: int, pieces: int = 1) -> tuple[float, float]:
        x, y = batch(step)
        losses = []
        for xs, ys in zip(x.chunk(pieces), y.chunk(pieces)):
            loss = loss_fn(self.model(xs), ys)
            (loss / pieces).backward()
            losses.append(loss.item())
        norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), MAX_NORM)
        self.optimizer.step()
        self.optimizer.zero_grad()
        return sum(losses) / pieces, norm.item()

    def params(self, names: list[str]) -> dict[str, torch.Tensor]:
        state = self.model.state_dict()
        return {n: state[n].clone() for n in names}


def _init() -> None:
    if not dist.is_initialized():
        dist.init_process_group("gloo")


def _finish() -> None:
    dist.barrier()
    dist.destroy_process_group()


def _full(value: torch.Tensor) -> torch.Tensor:
    return (value.full_tensor() if hasattr(value, "full_tensor") else value).detach().clone()


class Layout:
    """A (pp, dp) layout on this job's ranks: the cut model, its stage modules, runner and optimizer."""

    def __init__(
        self,
        pp: int,
        dp: int,
        dp_kind: str = "none",
        schedule: str = "1F1B",
        microbatches: int | None = None,
        mp: bool = False,
        num_blocks: int = 4,
    ):
        dim = "dp_replicate" if dp_kind == "ddp" else "dp_shard"
        self.mesh = init_device_mesh("cpu", (pp, dp), mesh_dim_names=("pp", dim))
        self.dp_group = self.mesh[dim].get_group()
        self.pp_rank, self.dp_rank, self.dp = self.mesh["pp"].get_local_rank(), self.mesh[dim].get_local_rank(), dp
        self.num_blocks = num_blocks
        model = new_model(num_blocks)
        chain = pipe.find_chain(model)
        per_rank = pipe.stages_per_rank(schedule)
        stages = pipe.split_stages(chain, pp * per_rank)
        self.rank = pipe.cut_model(model, chain, stages, pipe.stage_indices(schedule, self.pp_rank, pp, per_rank))
        if dp_kind == "ddp":
            modules = pipeline_dp.apply_ddp(self.rank, self.mesh[dim])
        elif dp_kind == "zero3":
            from torch.distributed.fsdp import MixedPrecisionPolicy

            policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if mp else None
            modules = pipeline_dp.apply_fsdp(self.rank, self.mesh[dim], **({"mp_policy": policy} if policy else {}))
        else:
            modules = self.rank.stages
        self.model = self.rank.model
        self.optimizer = make_optimizer(self.model, LR)
        self.runner = pipe.PipelineRunner(
            modules,
            self.rank.stage_indices,
            self.rank.num_stages,
            self.mesh["pp"],
            "cpu",
            schedule,
            microbatches,
            loss_fn,
        )

    def shard(self, x: torch.Tensor) -> torch.Tensor:
        size = x.size(0) // self.dp
        return x[self.dp_rank * size : (self.dp_rank + 1) * size]

    def step(self, step: int, pieces: int = 1) -> tuple[float, float]:
        x, y = (self.shard(t) for t in batch(step))
        losses = []
        for xs, ys in zip(x.chunk(pieces), y.chunk(pieces)):
            losses.append(self.runner.step(xs, ys, loss_scale=1.0 / pieces))
        norm = pipe.clip_grad_norm_(self.model.parameters(), MAX_NORM, pp_group=self.mesh["pp"])
        self.optimizer.step()
        self.optimizer.zero_grad()
        loss = torch.stack(losses).mean()
        dist.all_reduce(loss, op=dist.ReduceOp.AVG, group=self.dp_group)  # the global batch's loss
        return loss.item(), norm.item()

    def params(self) -> dict[str, torch.Tensor]:
        return {n: _full(v) for n, v in self.model.state_dict().items()}


def _train_side_by_side(layout: Layout, steps: int, accumulate: bool = False) -> dict[str, Any]:
    """`accumulate`: after a first whole step, each step in 2 pipeline steps of half the batch.
    Half-way, both evaluate this rank's share of a batch of 12 (where the schedule can)."""
    ref = Reference(layout.num_blocks)
    out: dict[str, Any] = {"losses": [], "ref_losses": [], "norms": [], "ref_norms": []}
    for step in range(steps):
        if step == steps // 2 and layout.runner.schedule not in pipe.schedules.V_SHAPED:
            x = layout.shard(batch(99, size=12)[0])
            with torch.no_grad():
                out["eval"], out["ref_eval"] = layout.runner.forward(x), ref.model(x)
        pieces = 2 if accumulate and step > 0 else 1
        loss, norm = layout.step(step, pieces)
        ref_loss, ref_norm = ref.step(step, pieces)
        out["losses"].append(loss)
        out["norms"].append(norm)
        out["ref_losses"].append(ref_loss)
        out["ref_norms"].append(ref_norm)
    out["params"] = layout.params()
    out["ref_params"] = ref.params(list(out["params"]))
    out["model_names"] = list(ref.model.state_dict())
    out["stage_indices"] = layout.rank.stage_indices
    out["ref"] = ref
    return out


def pp_only(steps: int) -> dict[str, Any]:
    """pp2 on 2 ranks: each schedule, accumulation, a changed batch shape, evaluation."""
    _init()
    results: dict[str, Any] = {}
    for schedule in pipe.SCHEDULES:
        result = _train_side_by_side(Layout(2, 1, schedule=schedule), steps)
        result.pop("ref")
        results[schedule] = result
    # accumulation over 2 pipeline steps of half the batch each (a new input shape for the runner)
    layout = Layout(2, 1, microbatches=2)
    layout.runner.refuse_direct_calls(layout.model)  # the runner's own calls stay allowed
    result = _train_side_by_side(layout, steps, accumulate=True)
    result.pop("ref")
    results["accumulate"] = result
    # bf16 autocast per stage, as phalanx's replicated strategies apply mixed precision
    autocast = Layout(2, 1)
    seen: list[str] = []
    for stage in autocast.rank.stages:
        Precision("bf16", torch.device("cpu")).wrap_forward(stage)
    block = autocast.model.get_submodule(next(n for n in autocast.rank.units if n.startswith("layers.")))
    block.fc1.register_forward_hook(lambda m, a, out: seen.append(str(out.dtype)))
    result = _train_side_by_side(autocast, steps)
    result.pop("ref")
    results["autocast"] = dict(result, fc1_dtypes=sorted(set(seen)))
    x = batch(99, size=6)[0]
    try:
        layout.model(x)
    except RuntimeError as e:
        results["direct_call"] = str(e)
    v_layout = Layout(2, 1, schedule="ZBVZeroBubble")
    try:
        v_layout.runner.forward(x)
    except ValueError as e:
        results["v_forward"] = str(e)
    _finish()
    return results


def pp_dp(steps: int, tmp: str) -> dict[str, Any]:
    """On 4 ranks: pp2 x ddp2 and pp2 x zero3 (1F1B, interleaved, bf16 parameters; accumulation under
    ddp and zero3), and pp4 (middle stages talk to both neighbours). The pp2 x ddp2 and interleaved
    pp2 x zero3 runs save a checkpoint after their steps under tmp/pp2xddp, tmp/pp2xzero3_interleaved."""
    _init()
    results: dict[str, Any] = {}
    for name, pp, kind, schedule, mp, blocks, accumulate in (
        ("ddp", 2, "ddp", "1F1B", False, 4, True),
        ("zero3", 2, "zero3", "1F1B", False, 4, True),
        ("zero3_interleaved", 2, "zero3", "Interleaved1F1B", False, 4, False),
        ("zero3_bf16", 2, "zero3", "1F1B", True, 4, False),
        ("pp4", 4, "none", "1F1B", False, 4, False),
        ("pp4_interleaved", 4, "none", "Interleaved1F1B", False, 8, False),
    ):
        layout = Layout(pp, 4 // pp, kind, schedule, 2 if accumulate else None, mp, blocks)  # 2 halves of 4 samples
        dtypes: list[torch.dtype] = []
        if layout.pp_rank == 0:  # what stage 0 sends to stage 1
            layout.rank.stages[0].register_forward_hook(lambda m, a, out, dtypes=dtypes: dtypes.append(out.dtype))
        result = _train_side_by_side(layout, steps, accumulate)
        result["sent_dtypes"] = sorted({str(d) for d in dtypes})
        result.pop("ref")
        results[name] = result
        if name in ("ddp", "zero3_interleaved"):  # one stage per rank, and two (views) under FSDP2
            dcp.save(pipe.get_state(layout.model, layout.optimizer), checkpoint_id=f"{tmp}/pp2x{name}")
            result["saved_keys"] = sorted(pipe.get_state(layout.model)["model"])
            result["full"] = pipe.gather_full_state_dict(layout.model, layout.mesh["pp"])
    _finish()
    return results


def _continue(layout_or_model: Any, first: int, steps: int) -> list[float]:
    return [layout_or_model.step(s)[0] for s in range(first, first + steps)]


def resume_moves(tmp: str, done: int, steps: int) -> dict[str, Any]:
    """On 2 ranks: zero3 loads the pp2 x ddp2 checkpoint and trains on, saves; pp2 loads that and
    trains on. Each continues the global batches from where the save left off."""
    _init()
    from torch.distributed.fsdp import fully_shard

    out: dict[str, Any] = {}
    # zero3 on 2 ranks (no pipeline): every block a unit, the root last
    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("dp_shard",))
    model = new_model()
    for block in model.layers:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    optimizer = make_optimizer(model, LR)
    state = pipe.get_state(model, optimizer)
    dcp.load(state, checkpoint_id=f"{tmp}/pp2xddp")
    pipe.set_state(model, optimizer, state)
    losses = []
    for s in range(done, done + steps):
        x, y = (t.chunk(2)[dist.get_rank()] for t in batch(s))
        loss = loss_fn(model(x), y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)
        optimizer.step()
        optimizer.zero_grad()
        loss = loss.detach()
        dist.all_reduce(loss, op=dist.ReduceOp.AVG)
        losses.append(loss.item())
    out["zero3_losses"] = losses
    dcp.save(pipe.get_state(model, optimizer), checkpoint_id=f"{tmp}/zero3")
    # back into pp2 (no data parallel)
    layout = Layout(2, 1)
    state = pipe.get_state(layout.model, layout.optimizer)
    dcp.load(state, checkpoint_id=f"{tmp}/zero3")
    pipe.set_state(layout.model, layout.optimizer, state)
    out["pp_losses"] = _continue(layout, done + steps, steps)
    out["pp_params"] = layout.params()
    _finish()
    return out


def load_whole(checkpoint: str) -> dict[str, torch.Tensor]:
    """The whole model loaded from a pipeline checkpoint in one process without a process group."""
    model = new_model()
    optimizer = make_optimizer(model, LR)
    state = pipe.get_state(model, optimizer)
    dcp.load(state, checkpoint_id=checkpoint)
    pipe.set_state(model, optimizer, state)
    return {
        "params": {n: v.clone() for n, v in model.state_dict().items()},
        "exp_avg": {n: optimizer.state[p]["exp_avg"].clone() for n, p in model.named_parameters()},
    }


def reference_run(steps: int) -> tuple[list[float], dict[str, torch.Tensor], Reference]:
    ref = Reference()
    losses = [ref.step(s)[0] for s in range(steps)]
    return losses, ref.params(list(ref.model.state_dict())), ref
