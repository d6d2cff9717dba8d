"""zenflow: ZenFlow offloaded training as a torch.compile backend plus a runtime.

Public names load lazily so that resolving the ``zenflow`` backend by its entry point stays cheap.
"""

import importlib

__version__ = "0.1.0"

_PUBLIC = {
    "ZenFlowConfig": "zenflow.config",
    "load_config": "zenflow.config",
    "ConfigError": "zenflow.validation",
    "build_lr_scheduler": "zenflow.config",
    "ZenFlowSettings": "zenflow.settings",
    "ReferenceZenFlowAdamW": "zenflow.reference",
    "CPUAdamW": "zenflow.cpu_adamw",
    "ZenFlowAdamW": "zenflow.optimizer",
    "StagedGradient": "zenflow.runtime.staged_gradient",
    # Failures a long run may want to catch (see README's reliability section).
    "NonFiniteGradientError": "zenflow.runtime.nonfinite",
    "CPUAdamError": "zenflow.runtime.cpu_adam",
    "CollectiveError": "zenflow.runtime.comm",
    "initialize": "zenflow.engine",
}

__all__ = sorted(_PUBLIC)


def __getattr__(name):
    module = _PUBLIC.get(name)
    if module is None:
        raise AttributeError(f"module 'zenflow' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)
