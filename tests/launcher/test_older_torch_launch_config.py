"""torch >= 2.6 is supported: agent fields an older LaunchConfig lacks are dropped while they hold
torchrun's defaults, and refused (never silently ignored) when the user asked for them."""

import dataclasses

import pytest
import torch.distributed.launcher.api as launcher_api

from phalanx.launch import torchrun_flags
from phalanx.launch.spec import LaunchError


@dataclasses.dataclass
class OlderLaunchConfig:  # the fields torch 2.11's LaunchConfig has that phalanx passes
    role: str = "default"
    monitor_interval: float = 0.1
    logs_specs: object = None
    log_line_prefix_template: object = None
    event_log_handler: str = "null"
    signals_to_handle: str = "SIGTERM,SIGINT,SIGHUP,SIGQUIT"


def test_defaults_of_newer_fields_are_dropped_and_asked_ones_refused(monkeypatch):
    monkeypatch.setattr(launcher_api, "LaunchConfig", OlderLaunchConfig)
    kwargs = torchrun_flags.launch_config_kwargs(torchrun_flags.AgentOptions())
    assert set(kwargs) <= {f.name for f in dataclasses.fields(OlderLaunchConfig)}
    with pytest.raises(LaunchError, match=r"elastic agent has no shutdown_timeout; HINT: drop the flag"):
        torchrun_flags.launch_config_kwargs(torchrun_flags.AgentOptions(shutdown_timeout=30))
