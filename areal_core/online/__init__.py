"""Online: retraining on sessions collected from live traffic (retrain.py) and the MLflow model
registry (registry.py: a finished run's registration, register-if-better, loading a version)."""
