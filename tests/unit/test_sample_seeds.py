"""Per-sample seeds in DataLoader workers: a sample's draws depend on (seed, epoch, index) only."""

import pickle
import random

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset

from phalanx import Phalanx
from phalanx.data.sample_seeds import SampleKey


class Draws(Dataset):
    def __init__(self, n: int = 12):
        self.n, self.scale = n, 1.0

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int):
        assert type(i) is int  # the user's dataset sees plain indices
        return torch.tensor([float(i), torch.rand(1).item() * self.scale, float(np.random.rand()), random.random()])


class BatchDraws(Draws):
    def __getitems__(self, indices: list[int]):
        return [self[i] for i in indices]


def _epochs(dataset: Dataset, **loader_kwargs) -> list[torch.Tensor]:
    loader = Phalanx(seed=11).prepare(DataLoader(dataset, batch_size=4, shuffle=True, **loader_kwargs))
    return [torch.cat(list(loader)) for _ in range(2)]


def test_draws_do_not_depend_on_the_number_of_workers():
    one = _epochs(Draws(), num_workers=1)
    two = _epochs(Draws(), num_workers=2)
    kept = _epochs(Draws(), num_workers=2, persistent_workers=True)
    for epoch in (0, 1):
        assert torch.equal(one[epoch], two[epoch]) and torch.equal(one[epoch], kept[epoch])
    # A new epoch: same samples, new order and new draws for every sample.
    first, second = (e[e[:, 0].argsort()] for e in one)
    assert torch.equal(first[:, 0], second[:, 0])
    assert (first[:, 1:] != second[:, 1:]).all()
    # Distinct across samples and sources.
    assert len(set(first[:, 1:].flatten().tolist())) == 3 * 12


def test_a_dataset_loading_whole_batches_is_seeded_per_batch():
    one, two = _epochs(BatchDraws(), num_workers=1), _epochs(BatchDraws(), num_workers=2)
    assert all(torch.equal(a, b) for a, b in zip(one, two))


def test_prepared_loader_shows_the_users_dataset_and_worker_init_configures_it():
    dataset = Draws()

    def init(worker_id: int) -> None:
        torch.utils.data.get_worker_info().dataset.scale = 0.0

    loader = Phalanx(seed=1).prepare(DataLoader(dataset, batch_size=4, num_workers=2, worker_init_fn=init))
    assert loader.dataset is dataset
    assert (torch.cat(list(loader))[:, 1] == 0).all()  # the attribute reached the user's dataset


def test_sample_key_is_an_index_that_keeps_its_epoch_through_pickle():
    key = pickle.loads(pickle.dumps(SampleKey(5, 3)))
    assert (int(key), key.epoch) == (5, 3) and [0, 1, 2, 3, 4, 5][key] == 5
