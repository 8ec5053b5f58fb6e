import verifiers.v1 as vf


class VfToolCalcToolset(vf.Toolset[vf.ToolsetConfig]):
    TOOL_PREFIX = "calc"

    @vf.tool
    def add(self, a: int, b: int) -> str:
        """Return the sum of two integers."""
        return str(a + b)


if __name__ == "__main__":
    VfToolCalcToolset.run()
