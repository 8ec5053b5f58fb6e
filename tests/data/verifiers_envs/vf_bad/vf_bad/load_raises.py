import verifiers.v1 as vf


class LoadRaisesData(vf.TaskData):
    answer: str


class LoadRaisesTask(vf.Task[LoadRaisesData]):
    @vf.reward(weight=1.0)
    async def correct(self, trace: vf.Trace) -> float:
        return 0.0


class LoadRaisesTaskset(vf.Taskset[LoadRaisesTask, vf.TasksetConfig]):
    def load(self) -> list[LoadRaisesTask]:
        raise ConnectionError("the dataset host is unreachable")


__all__ = ["LoadRaisesTaskset"]
