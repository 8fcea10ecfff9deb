"""Dimension rules: per-op signatures saying which dims may be split and what the pieces produce."""
from nnscaler_plugins.rules.signature import (
           Labels,
           LocalCall,
           Localized,
           OpCall,
           Signature,
           replicate_only,
)
from nnscaler_plugins.rules.table import (
           ReplicateOnlyWarning,
           has_rule,
           op_call,
           refresh,
           rule,
           signature_for,
           signature_of,
           unruled_ops,
)
from nnscaler_plugins.rules import user_functions  # noqa: F401 - keeps torch's own Function.apply before any capture

__all__ = ["Labels", "LocalCall", "Localized", "OpCall", "Signature", "replicate_only", "ReplicateOnlyWarning",
           "has_rule", "op_call", "refresh", "rule", "signature_for", "signature_of", "unruled_ops"]
