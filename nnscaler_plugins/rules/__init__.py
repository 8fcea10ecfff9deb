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

__all__ = ["Labels", "LocalCall", "Localized", "OpCall", "Signature", "replicate_only", "ReplicateOnlyWarning",
           "has_rule", "op_call", "refresh", "rule", "signature_for", "signature_of", "unruled_ops"]
