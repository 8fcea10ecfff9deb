"""`deepspeed.runtime.pipe`: PipelineModule, LayerSpec and TiedLayerSpec (see ../../pipeline_module.py)."""
from .module import LayerSpec, PipelineModule, TiedLayerSpec

__all__ = ["PipelineModule", "LayerSpec", "TiedLayerSpec"]
