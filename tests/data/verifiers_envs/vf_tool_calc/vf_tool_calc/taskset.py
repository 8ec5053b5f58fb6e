import random
import re

import verifiers.v1 as vf

from vf_tool_calc.servers.tool import VfToolCalcToolset


class VfToolCalcData(vf.TaskData):
    """One sum to compute with the tool; `answer` is the reference."""

    answer: str


class VfToolCalcTaskConfig(vf.TaskConfig):
    """Knobs the task reads from ``self.config``; configure them under ``--env.taskset.task.*``."""

    tools: vf.ToolsetConfig = vf.ToolsetConfig()


class VfToolCalcTask(vf.Task[VfToolCalcData, vf.State, VfToolCalcTaskConfig]):
    """The add tool, and rewards on the final reply and on the tool's use."""

    @classmethod
    def toolsets(cls, config: VfToolCalcTaskConfig) -> list[vf.Toolset]:
        return [VfToolCalcToolset(config.tools)]

    @vf.reward(weight=1.0)
    async def correct(self, trace: vf.Trace) -> float:
        numbers = re.findall(r"-?\d+", trace.last_reply)
        return 1.0 if numbers and numbers[-1] == self.data.answer else 0.0

    @vf.reward(weight=0.25)
    async def used_tool(self, trace: vf.Trace) -> float:
        return 1.0 if trace.tool_messages else 0.0


class VfToolCalcConfig(vf.TasksetConfig):
    num_tasks: int = 32
    """How many tasks to build."""
    task: VfToolCalcTaskConfig = VfToolCalcTaskConfig()


class VfToolCalcTaskset(vf.Taskset[VfToolCalcTask, VfToolCalcConfig]):
    def load(self) -> list[VfToolCalcTask]:
        rng = random.Random(7)
        tasks = []
        for i in range(self.config.num_tasks):
            a, b = rng.randint(10, 99), rng.randint(10, 99)
            prompt = f"Use the add tool to compute {a} + {b}, then reply with the number."
            tasks.append(
                VfToolCalcTask(VfToolCalcData(id=f"add-{i}", prompt=prompt, answer=str(a + b)), self.config.task)
            )
        return tasks
