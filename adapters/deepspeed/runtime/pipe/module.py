"""`deepspeed.runtime.pipe.module`: DeepSpeed's path of the pipeline model classes (they live in
`pipeline_module.py`, below the engine that runs them)."""
from ...pipeline_module import LayerSpec, PipelineModule, TiedLayerSpec

__all__ = ["PipelineModule", "LayerSpec", "TiedLayerSpec"]
