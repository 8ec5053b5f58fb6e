"""Data and reward functions as verl and TRL users already have them, used unchanged (docs/coming_from.md)."""
