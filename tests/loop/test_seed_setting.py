"""seed_everything and Phalanx's seed setting, in one process."""

import random
import subprocess
import sys

import numpy as np
import pytest
import torch

import phalanx
from phalanx import config
from phalanx.runtime import seeding


def _draws():
    return random.random(), float(np.random.rand()), torch.rand(1).item()


@pytest.fixture(autouse=True)
def no_seed_from_outside(monkeypatch):
    monkeypatch.delenv("PHALANX_SEED", raising=False)


def test_seed_everything_seeds_python_numpy_and_torch():
    assert phalanx.seed_everything(7) == 7
    first = _draws()
    phalanx.seed_everything(7)
    assert _draws() == first
    phalanx.seed_everything(8)
    assert _draws() != first


def test_import_phalanx_does_not_import_torch():
    code = "import phalanx, sys; assert 'torch' not in sys.modules; print(callable(phalanx.seed_everything))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "True"


def test_phalanx_seeds_globals_only_when_a_seed_is_given():
    phalanx.seed_everything(5)
    expected = _draws()
    phalanx.seed_everything(5)
    px = phalanx.Phalanx()  # no seed: global RNGs untouched; seed_everything records nothing
    assert px.seed == 0
    assert _draws() == expected
    random.seed(99)
    px = phalanx.Phalanx(seed=phalanx.seed_everything(5))  # the seed passed on
    assert px.seed == 5 and _draws() == expected


def test_no_seed_given_means_data_order_from_0_and_rngs_untouched():
    assert config.BY_NAME["seed"].default is None  # "not given": the global RNGs are left alone
    phalanx.seed_everything(123)  # a process-wide seed elsewhere does not leak into Phalanx()
    before = torch.get_rng_state()
    assert phalanx.Phalanx().seed == 0
    assert torch.equal(torch.get_rng_state(), before)


def test_seed_everything_workers_false_says_where_the_setting_went():
    with pytest.warns(FutureWarning, match=r"HINT: Phalanx\(worker_seeds='shared'\)"):
        assert phalanx.seed_everything(4, workers=False) == 4


def test_seed_from_env_and_bad_values(monkeypatch):
    monkeypatch.setenv("PHALANX_SEED", "11")
    assert phalanx.Phalanx().seed == 11
    monkeypatch.setenv("PHALANX_SEED", "eleven")
    with pytest.raises(ValueError, match=r"PHALANX_SEED=eleven: expected a whole number"):
        phalanx.Phalanx()
    with pytest.raises(ValueError, match=r"seed must be an integer, got '3'"):
        phalanx.seed_everything("3")


def test_worker_base_seeds_differ_per_rank_and_epoch():
    seeds = {seeding.worker_base_seed(3, rank, epoch) for rank in range(4) for epoch in range(4)}
    assert len(seeds) == 16
    assert seeding.worker_base_seed(3, 1, 2) == seeding.worker_base_seed(3, 1, 2)
    assert all(0 <= s < 2**63 for s in seeds)


class _WorkerSeeds(torch.utils.data.Dataset):
    def __len__(self):
        return 4

    def __getitem__(self, i):
        info = torch.utils.data.get_worker_info()
        return torch.tensor([info.seed - info.id, info.id])


def _first_base_seeds(workers: bool) -> set[int]:
    px = phalanx.Phalanx(seed=3, worker_seeds="per_rank" if workers else "shared")
    loader = px.prepare(torch.utils.data.DataLoader(_WorkerSeeds(), batch_size=1, num_workers=2))
    rows = torch.cat([batch for batch in loader])
    assert sorted(rows[:, 1].tolist()) == [0, 0, 1, 1]
    return set(rows[:, 0].tolist())


def _draw(generator_seed: int) -> int:
    return int(torch.empty((), dtype=torch.int64).random_(generator=torch.Generator().manual_seed(generator_seed)))


def test_worker_base_seed_comes_from_seed_rank_and_epoch():
    # Worker w gets base + w; the base is drawn from the loader's generator, seeded per (seed, rank, epoch).
    assert _first_base_seeds(workers=True) == {_draw(seeding.worker_base_seed(3, 0, 0))}
    # shared: torch's default seeding from a generator seeded with seed + epoch (the same on every rank).
    assert _first_base_seeds(workers=False) == {_draw(3)}
