import math
import re

import verifiers.v1 as vf


class FlakyData(vf.TaskData):
    answer: str


class FlakyTask(vf.Task[FlakyData]):
    """By task index: the reward raises after the model replied (0), the rubric is NaN (1), fine (2)."""

    @vf.reward(weight=1.0)
    async def correct(self, trace: vf.Trace) -> float:
        kind = self.data.idx % 3
        if kind == 0:
            raise RuntimeError(f"the grader crashed on task {self.data.idx}")
        if kind == 1:
            return math.nan
        numbers = re.findall(r"-?\d+", trace.last_reply)
        return 1.0 if numbers and numbers[-1] == self.data.answer else 0.0


class FlakyConfig(vf.TasksetConfig):
    num_tasks: int = 30


class FlakyTaskset(vf.Taskset[FlakyTask, FlakyConfig]):
    def load(self) -> list[FlakyTask]:
        return [
            FlakyTask(FlakyData(prompt=f"What is {i} + {i}?", answer=str(2 * i)), self.config.task)
            for i in range(self.config.num_tasks)
        ]


__all__ = ["FlakyTaskset"]
