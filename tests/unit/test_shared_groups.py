"""The optimizer phalanx steps in place of the user's shares the user's param_group dicts, across a
load_state_dict too: a scheduler built on the user's optimizer keeps setting the lr that steps."""

import torch

from phalanx.strategies.optimizers.shared_groups import keeping_groups, shared_groups


def test_a_loaded_state_goes_into_the_shared_dicts():
    params = [torch.nn.Parameter(torch.ones(2))]
    users = torch.optim.AdamW(params, lr=0.1)
    scheduler = torch.optim.lr_scheduler.LambdaLR(users, lambda step: 0.5)  # built on the user's optimizer
    stepping = torch.optim.AdamW(shared_groups(users), lr=0.1)
    assert stepping.param_groups[0] is users.param_groups[0]
    saved = stepping.state_dict()
    saved["param_groups"][0]["lr"] = 0.02
    with keeping_groups(stepping):
        stepping.load_state_dict(saved)
    assert stepping.param_groups[0] is users.param_groups[0] and users.param_groups[0]["lr"] == 0.02
    scheduler.step()
    assert stepping.param_groups[0]["lr"] == 0.05  # what the scheduler set is what steps
    assert stepping.param_groups[0]["params"] == params
