"""Pod emulation: test tooling that executes a serialized Flyte workflow the way a Flyte cluster
would run it, so that what a cluster would execute is executed here. It is not a scheduler.

- package.py: `pyflyte package` in a fresh process (the registration: with the cluster config
  file in its environment), parsed into task templates, workflow templates and launch plans.
- pods.py: one pod: the task's own container command with the template variables filled, in a
  fresh process whose environment holds only what the task spec declares, what Flyte and the
  Kubeflow operator inject, the image's PATH/PYTHONPATH and S3 credentials; inputs and outputs
  as Flyte literal maps (protobuf) on S3.
- execute.py: walks the workflow's node graph in dependency order, resolving bindings from
  upstream outputs; nodes whose upstreams are done run concurrently; array nodes get one pod per
  element (the index in the environment, as Flyte passes it); a PyTorchJob gets one pod per
  worker replica with the operator's PET_* environment. When a node fails, the other pods are
  stopped and the workflow's failure node runs (its `err` input holds the failed node and the
  message); `evict` kills a task's pods a given time after they start (retries spent).
"""
