"""``ipcsync-run``: launch and supervise a pipeline of stage processes.

Layers, torchrun style: ``spec`` (parse and validate, pure) -> ``plan`` (resolve devices,
endpoints and each process's wiring, pure) -> ``supervisor`` (processes) ; ``cli`` ties
them together: ``parse_args -> config_from_args`` (a ``config.LaunchConfig``: the spec and
every option, checked when built) ``-> run(config)``.
"""

from .spec import EdgeSpec, PipelineSpec, SpecError, StageSpec, from_cli, load, loads

__all__ = ["EdgeSpec", "PipelineSpec", "SpecError", "StageSpec", "from_cli", "load", "loads"]
