"""The run layer: prepare a run root, launch the roles, the role entry point, tracking."""
