"""Framework adapters (Lightning, Hugging Face Trainer, DeepSpeed configs), each a plugin.

The core never imports this package; adapters register through the `nnscaler_plugins` hooks
exactly like a third-party plugin would.
"""
