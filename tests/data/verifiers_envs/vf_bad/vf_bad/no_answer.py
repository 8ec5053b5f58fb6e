import verifiers.v1 as vf


class NoAnswerData(vf.TaskData):
    """A question and its solution, under a name that is not `answer`."""

    solution: str


class NoAnswerTask(vf.Task[NoAnswerData]):
    @vf.reward(weight=1.0)
    async def correct(self, trace: vf.Trace) -> float:
        return float(trace.last_reply == self.data.solution)


class NoAnswerTaskset(vf.Taskset[NoAnswerTask, vf.TasksetConfig]):
    def load(self) -> list[NoAnswerTask]:
        return [NoAnswerTask(NoAnswerData(prompt=f"Say {i}.", solution=str(i))) for i in range(4)]


__all__ = ["NoAnswerTaskset"]
