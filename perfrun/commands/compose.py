"""A composed configuration (Hydra's DictConfig) made the schema's dataclasses: each command
does it once, at the top of a job (``perfrun train``'s task, each ``perfrun tune`` trial),
and the library takes the typed pieces (perfrun/config.py) from there."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from perfrun.config import ConfigError, TrainConfig

if TYPE_CHECKING:
    from omegaconf import DictConfig


def typed(composed: DictConfig) -> TrainConfig:
    """The composed configuration, its ``hydra`` node left out, as a TrainConfig. A key the
    schema lacks (Hydra's ``+key=value`` can add one) is refused here, where it is seen."""
    from omegaconf import OmegaConf, open_dict

    job = composed.copy()  # Hydra's own stays as it composed it
    with open_dict(job):
        job.pop("hydra", None)
    unknown = unknown_keys(job, OmegaConf.structured(TrainConfig))
    if unknown:
        raise ConfigError(
            f"{', '.join(unknown)}: not a key perfrun knows; remove it "
            "(perfrun train --cfg job lists the keys)"
        )
    return OmegaConf.to_object(job)  # type: ignore[return-value]


def unknown_keys(node: Any, schema: Any, prefix: str = "") -> list[str]:
    """Keys in ``node`` that the schema lacks."""
    from omegaconf import DictConfig

    unknown = []
    for key in node.keys() if isinstance(node, DictConfig) else []:
        if key not in schema:
            unknown.append(f"{prefix}{key}")
        elif isinstance(schema[key], DictConfig):
            unknown += unknown_keys(node[key], schema[key], f"{prefix}{key}.")
    return unknown
