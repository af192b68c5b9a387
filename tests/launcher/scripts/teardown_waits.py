"""A plain torch DDP script (gloo, the process group never destroyed, as Accelerate leaves it) that
finishes its training, then waits in the interpreter's teardown, as gloo's `~AsyncAllgatherWork`
can wait on the interpreter lock there: an object collected at finalization blocks for 180 s (the
race made certain). `--linger S`: an exit handler also waits S seconds (a job a timeout stops
after its last step). `--exit N`: rank 1 then ends with sys.exit(N). Each rank prints DONE when
training is over."""

import atexit
import sys
import time

import torch
import torch.distributed as dist


class HeldAtTeardown:
    def __del__(self):
        time.sleep(180)


dist.init_process_group("gloo")
torch.manual_seed(0)
model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(4, 1))
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
for _ in range(4):
    optimizer.zero_grad()
    torch.nn.functional.mse_loss(model(torch.randn(4, 4)), torch.randn(4, 1)).backward()
    optimizer.step()
gathered = [torch.zeros(1) for _ in range(dist.get_world_size())]
dist.all_gather(gathered, torch.ones(1), async_op=True).wait()
# held by a module: collected only when the interpreter tears down, also when runpy runs this file
# (--run-path), whose globals are dropped when it returns
torch.distributed._held_at_teardown = HeldAtTeardown()
if "--linger" in sys.argv:
    atexit.register(time.sleep, float(sys.argv[sys.argv.index("--linger") + 1]))
print("DONE", dist.get_rank(), flush=True)
if "--exit" in sys.argv and dist.get_rank() == 1:
    sys.exit(int(sys.argv[sys.argv.index("--exit") + 1]))
