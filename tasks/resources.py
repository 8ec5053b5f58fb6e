"""Images and resources the tasks request (cluster values; the local executor ignores them)."""

from __future__ import annotations

from flytekit import Resources

from images.specs import cpu_image

IMAGE = cpu_image()
SMALL = Resources(cpu="1", mem="2Gi")
ROLE = Resources(cpu="2", mem="8Gi")
