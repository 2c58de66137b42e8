"""The proving ground of the adaptive controllers: traces (`adaptipe.envs.trace`), one
simulated training run under a trace (`adaptipe.envs.episode`), and the gymnasium
environments ``adaptipe/PipelineSwitch-v0`` and ``adaptipe/PipelineRepartition-v0``
(`adaptipe.envs.gym_envs`), registered on import."""

import gymnasium

for _id, _entry in (
    ("adaptipe/PipelineSwitch-v0", "adaptipe.envs.gym_envs:PipelineSwitch"),
    ("adaptipe/PipelineRepartition-v0", "adaptipe.envs.gym_envs:PipelineRepartition"),
):
    if _id not in gymnasium.registry:
        gymnasium.register(id=_id, entry_point=_entry)
