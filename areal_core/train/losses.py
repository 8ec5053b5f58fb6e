"""The loss functions under their first import path; they live in the loss registry, areal_core/train/loss/.

    from areal_core.train.losses import decoupled_ppo_loss, aggregate     # = areal_core.train.loss.*

One module per loss there (`decoupled_ppo.py`, `ppo.py`, `gspo.py`, `gspo_token.py`, `dpo.py`,
`ipo.py`, `critic.py`, ...), each with its formula in its docstring; the shared math (aggregation,
behaviour weights, KL estimators) in `loss/common.py`; the registry API in `loss/registry.py`.
Nothing is defined here.
"""

from areal_core.train.loss import *  # noqa: F403
from areal_core.train.loss import __all__  # noqa: F401
