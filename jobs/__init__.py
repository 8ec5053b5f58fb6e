"""The jobs, declared once for both Flyte front ends (docs/architecture.md, "Jobs"): plain Python that
imports areal_core and no Flyte SDK. `catalog.py` declares each job (inputs with types, defaults and
docs; output; steps; cache versions; schedule), `steps.py` holds each step's one call into areal_core,
and `spec.py` what a job is and the function both front ends build their SDK entities with."""
