"""Sharded, atomic, reshardable checkpoints.

    nns.checkpoint.save(path, module, optimizer, step=step, scheduler=sched.state_dict())
    handle = nns.checkpoint.save(path, module, optimizer, background=True, step=step)  # handle.wait()
    path = nns.checkpoint.latest("ckpt")                     # the newest complete one under a folder
    extra = nns.checkpoint.load(path, module, optimizer)     # any plan, any world size
    nns.checkpoint.export("model.pt", module)                # one ordinary state dict
    nns.checkpoint.export("hf_dir", module, hf_model=model)  # save_pretrained output
    nns.checkpoint.merge("ckpt_dir", "model.pt")             # offline, no processes
    nns.checkpoint.load("hf_dir", module)                    # a save_pretrained directory, read per shard
    nns.checkpoint.export_dcp("dcp_dir", module, optimizer)  # torch.distributed.checkpoint; load reads it back

save, load, export and export_dcp are collective (every rank calls them); merge runs anywhere.
"""
from nnscaler_plugins.checkpoint.background import SaveHandle
from nnscaler_plugins.checkpoint.dcp import export_dcp
from nnscaler_plugins.checkpoint.errors import CheckpointError
from nnscaler_plugins.checkpoint.export import export
from nnscaler_plugins.checkpoint.latest import is_complete, latest
from nnscaler_plugins.checkpoint.load import load
from nnscaler_plugins.checkpoint.merge import merge
from nnscaler_plugins.checkpoint.model_state import full_model_state
from nnscaler_plugins.checkpoint.optimizer_state import (
           full_optimizer_state,
           load_optimizer_state,
)
from nnscaler_plugins.checkpoint.save import save

__all__ = ["save", "load", "latest", "is_complete", "SaveHandle", "export", "export_dcp", "merge", "CheckpointError", "full_model_state", "full_optimizer_state",
           "load_optimizer_state"]
