"""Tasksets that fail on purpose; each module exports one (name them by import path)."""
