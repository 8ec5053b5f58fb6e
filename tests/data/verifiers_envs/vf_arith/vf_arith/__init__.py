from vf_arith.taskset import VfArithTaskset

__all__ = ["VfArithTaskset"]
