"""A trainer job from the JSON a multi-rank test hands its rank processes (dataclasses.asdict of a
TrainJob, written to the spec file)."""

from __future__ import annotations

from data_pipeline.provenance import Provenance
from dflash_dist.model.config import DrafterConfig
from dflash_dist.trainer.loop import TrainJob
from dflash_dist.trainer.resume import ResumeDecision


def job_from_json(j: dict) -> TrainJob:
    """The TrainJob whose asdict() is `j`: its provenance, drafter config and resume decision rebuilt."""
    drafter = DrafterConfig(**(j["drafter"] | {"target_layer_ids": tuple(j["drafter"]["target_layer_ids"])}))
    resume = None if j.get("resume") is None else ResumeDecision.from_dict(j["resume"])
    return TrainJob(**(j | {"provenance": Provenance.from_dict(j["provenance"]), "drafter": drafter, "resume": resume}))
