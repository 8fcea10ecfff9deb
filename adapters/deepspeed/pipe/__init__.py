"""`deepspeed.pipe`, where pipeline scripts import from: `from deepspeed.pipe import PipelineModule,
LayerSpec, TiedLayerSpec`."""
from ..runtime.pipe import LayerSpec, PipelineModule, TiedLayerSpec

__all__ = ["PipelineModule", "LayerSpec", "TiedLayerSpec"]
