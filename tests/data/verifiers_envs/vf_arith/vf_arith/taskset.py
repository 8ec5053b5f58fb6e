import random
import re

import verifiers.v1 as vf


class VfArithData(vf.TaskData):
    """One sum: the question is the prompt, `answer` the reference."""

    answer: str


class VfArithTask(vf.Task[VfArithData]):
    """Scored on the model's last reply."""

    @vf.reward(weight=1.0)
    async def correct(self, trace: vf.Trace) -> float:
        numbers = re.findall(r"-?\d+", trace.last_reply)
        return 1.0 if numbers and numbers[-1] == self.data.answer else 0.0

    @vf.reward(weight=0.5)
    async def has_number(self, trace: vf.Trace) -> float:
        return 1.0 if re.search(r"\d", trace.last_reply) else 0.0


class VfArithConfig(vf.TasksetConfig):
    num_tasks: int = 64
    """How many tasks to build."""
    seed: int = 0
    """The sums are drawn from this seed."""


class VfArithTaskset(vf.Taskset[VfArithTask, VfArithConfig]):
    def load(self) -> list[VfArithTask]:
        rng = random.Random(self.config.seed)
        tasks = []
        for i in range(self.config.num_tasks):
            a, b = rng.randint(1, 9), rng.randint(1, 9)
            data = VfArithData(id=f"sum-{i}", prompt=f"What is {a} + {b}?", answer=str(a + b))
            tasks.append(VfArithTask(data, self.config.task))
        return tasks
