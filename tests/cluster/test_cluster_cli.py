"""``python -m pagedkv.cluster``'s handling of settings its replicas refuse."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("ray")
pytest.importorskip("torch")

from pagedkv.cluster import cli  # noqa: E402
from pagedkv.engine.errors import DeviceUnavailableError, EngineConfigError  # noqa: E402


class _RemoteError(DeviceUnavailableError):
    """What Ray raises for a replica's error: a subclass of it whose text is the remote
    traceback, with the engine's own error as ``cause``."""

    def __init__(self, cause: Exception) -> None:
        super().__init__("Traceback (most recent call last):\n  ...\n" + str(cause))
        self.cause = cause


@pytest.mark.parametrize(
    "error",
    [
        EngineConfigError("block_size=5000 is invalid: must be in 1..=4096 tokens"),
        _RemoteError(DeviceUnavailableError("device='tpu' is not a torch device")),
    ],
)
def test_a_setting_the_replicas_refuse_exits_2_with_one_line(
    error: Exception, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    import pagedkv.cluster.cluster as cluster_mod  # noqa: PLC0415

    def refuse(*args: Any, **kwargs: Any) -> None:
        raise error

    monkeypatch.setattr(cluster_mod, "ReplicaCluster", refuse)
    prompts = tmp_path / "p.txt"
    prompts.write_text("hi\n")
    assert cli.main(["--prompts", str(prompts), "--replicas", "1"]) == 2
    err = capsys.readouterr().err
    cause = getattr(error, "cause", error)
    assert err == f"pagedkv.cluster: {cause}\n"


def test_a_replica_whose_engine_refuses_its_settings_raises_that_error_from_info() -> None:
    """Raised from ``__init__`` the error would reach the driver as Ray's ``ActorDiedError``;
    ``info`` (the cluster's first call) raises the engine's own error instead."""
    from pagedkv.cluster.replica import EngineReplica  # noqa: PLC0415

    replica = EngineReplica(0, None, {"device": "tpu"})
    with pytest.raises(DeviceUnavailableError, match="device='tpu' is not a torch device"):
        replica.info()
