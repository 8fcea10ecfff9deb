"""A DeepSpeed pipeline script (PipelineModule of LayerSpecs, train_batch) run under real DeepSpeed
or under the drop-in, the import the only difference: `torchrun ... deepspeed_pipe_job.py OUT real|ours`.
Rank 0 writes the train_batch losses to OUT."""
import json
import sys

import torch

OUT, WHICH = sys.argv[1], sys.argv[2]
if WHICH == "real":
    import deepspeed
    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False  # no JIT build: plain gloo collectives
    from deepspeed.pipe import LayerSpec, PipelineModule
else:
    from nnscaler_plugins.adapters import deepspeed
    from nnscaler_plugins.adapters.deepspeed.pipe import LayerSpec, PipelineModule

deepspeed.init_distributed(dist_backend="gloo")
specs = [LayerSpec(torch.nn.Linear, 8, 16), torch.nn.ReLU(), LayerSpec(torch.nn.Linear, 16, 16), torch.nn.Tanh(),
         LayerSpec(torch.nn.Linear, 16, 4)]
model = PipelineModule(specs, num_stages=2, loss_fn=torch.nn.CrossEntropyLoss(), seed_layers=True,
                       partition_method="uniform")
cfg = {"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 2, "gradient_clipping": 0.0,
       "optimizer": {"type": "SGD", "params": {"lr": 0.1}}, "steps_per_print": 100}
engine, _, _, _ = deepspeed.initialize(model=model, config=cfg, model_parameters=list(model.parameters()))
g = torch.Generator().manual_seed(10)
data = iter([(torch.randn(4, 8, generator=g), torch.randint(0, 4, (4,), generator=g)) for _ in range(6)])
losses = [float(engine.train_batch(data_iter=data)) for _ in range(3)]
if torch.distributed.get_rank() == 0:
    with open(OUT, "w") as f:
        json.dump(losses, f)
