"""Flyte tasks: thin wrappers over areal_core. No RL logic lives here."""
