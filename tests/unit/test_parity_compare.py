"""`phalanx parity`'s pure parts: the relaunch arguments, the verdict, and the causes it names."""

from phalanx.parity import compare
from phalanx.parity.command import run_args


def step(n, loss=1.0, norm=2.0, **extra):
    row = {
        "step": n,
        "loss": loss,
        "grad_norm": norm,
        "rank_losses": [loss],
        "world_size": 1,
        "seeds": [0],
        "rng": ["a"],
        "unsynced_batchnorm": [],
        "prepared_loaders": 1,
    }
    row.update(extra)
    return row


def many(n, loss=1.0, norm=2.0, **extra):
    return step(
        n,
        loss,
        norm,
        **{"world_size": 2, "rank_losses": [loss * 0.9, loss * 1.1], "seeds": [0, 0], "rng": ["a", "a"], **extra},
    )


def test_run_args_drop_parity_flags_and_set_the_process_count_before_the_script():
    argv = ["--steps", "4", "--strategy", "zero3", "--rtol=1e-3", "train.py", "--steps", "9"]
    assert run_args(argv, num_script_args=2, nproc=1) == [
        "--strategy",
        "zero3",
        "--nproc-per-node",
        "1",
        "train.py",
        "--steps",
        "9",
    ]
    assert run_args(["--nproc-per-node", "2", "-m", "pkg.train"], 0, 2) == [
        "--nproc-per-node",
        "2",
        "--nproc-per-node",
        "2",
        "-m",
        "pkg.train",
    ]  # the last one wins


def test_first_difference_uses_the_stated_tolerance():
    one = [step(1), step(2), step(3)]
    close = [many(1, 1.00005), many(2, norm=2.0001), many(3, 1.01)]
    assert compare.first_difference(one, close, rtol=1e-4) == 2
    assert compare.first_difference(one, close, rtol=1e-1) is None
    assert "<- differs" in compare.table(one, close, 2, 1e-4).splitlines()[3]


def test_causes_per_rank_seeds_and_an_unprepared_loader():
    bad = many(1, 1.3, seeds=[0, 1], rng=["a", "b"], prepared_loaders=0)
    causes = compare.likely_causes(step(1), bad, [bad])
    assert any(c.startswith("no DataLoader was prepared (px.prepare(loader))") for c in causes)
    assert any("randomness seeded per rank (torch's seed rank 0: 0, rank 1: 1)" in c for c in causes)
    assert not any("world size" in c for c in causes)


def test_causes_the_same_batches_on_every_rank_and_a_gradient_summed_over_ranks():
    same = many(1, 1.0, 4.0, rank_losses=[1.0, 1.0])
    causes = compare.likely_causes(step(1), same, [same])
    assert any("every process computed the same loss at every step" in c for c in causes)
    assert any(c.startswith("a gradient norm that scales with the world size: 2 x") for c in causes)


def test_shortfall_names_what_is_missing():
    assert "never called px.backward" in compare.shortfall(compare.Records([], None, False), 3, "t.py")
    assert "never called px.backward" in compare.shortfall(
        compare.Records([], {"end": True, "backward_calls": 0, "steps": 0}, True), 3, "t.py"
    )
    short = compare.Records([step(1)], {"end": True, "backward_calls": 4, "steps": 1}, True)
    assert compare.shortfall(short, 3, "t.py").startswith(
        "t.py took only 1 optimizer step (px.backward was called 4 times), fewer than --steps 3"
    )
    assert compare.shortfall(compare.Records([step(1)], None, True), 1, "t.py") is None
