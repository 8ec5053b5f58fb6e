from vf_tool_calc.taskset import VfToolCalcTaskset

__all__ = ["VfToolCalcTaskset"]
